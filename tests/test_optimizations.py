"""The speed optimizations (`model/optimizations/`): each alone and all together compute what transformers does
on the tiny model, the registry is the list `pipeline.toml` accepts, and each one's own pieces equal what they
replace. A newly registered optimization is tested here by being registered."""

import copy

import pytest
import torch

from sam3_aoti.model.configs import example_inputs
from sam3_aoti.model.grounding import DECODE_IMAGE_INPUTS, PARTS, Part, Sam3Grounding
from sam3_aoti.model.optimizations import REGISTRY
from sam3_aoti.pipeline.schema import OPTIMIZATIONS

OUTPUTS = ("logits", "boxes", "masks", "presence")


def test_the_registry_is_the_list_pipeline_toml_accepts_in_its_order():
    """`pipeline.schema.OPTIMIZATIONS` (read by doit without torch) names the registry's optimizations in the
    order they are applied; each comes after those it must follow, and names only parts that exist."""
    assert tuple(REGISTRY) == OPTIMIZATIONS
    order = list(REGISTRY)
    for name, optimization in REGISTRY.items():
        assert optimization.name == name
        assert all(order.index(other) < order.index(name) for other in optimization.after), name
        assert set(optimization.changes_parts) | set(optimization.part_reads) <= set(PARTS), name


def test_a_precision_adds_its_own_optimizations_to_the_build_at_that_precision_only(tiny_model):
    """`[export] precision_optimizations` (one that pays in fp8 and costs in bf16): the build at that precision
    exports with them too, in the registry's order; the others without."""
    from dataclasses import replace

    from sam3_aoti.pipeline.settings import load_settings

    settings = load_settings(device="cpu")
    export = {**settings.tables["export"], "optimizations": ["vit_fused_qkv", "relu_epilogue"],
              "precision_optimizations": {"fp8": ["vit_window_order", "box_bias_kernel"], "bf16": []}}
    settings = replace(settings, tables={**settings.tables, "export": export})
    assert settings.optimizations == ("relu_epilogue", "vit_fused_qkv")
    assert replace(settings, precision="bf16").optimizations == ("relu_epilogue", "vit_fused_qkv")
    assert replace(settings, precision="fp8").optimizations == (
        "box_bias_kernel", "relu_epilogue", "vit_fused_qkv", "vit_window_order")
    built = Sam3Grounding.built_as(copy.deepcopy(tiny_model), settings)  # optimizations change the model in place
    assert built.optimizations == ("relu_epilogue", "vit_fused_qkv")


def _shape_of(model) -> list:
    """What an optimization swaps: each module's class and attention implementation, and its parameters."""
    return [(name, type(module).__name__, getattr(getattr(module, "config", None), "_attn_implementation", None))
            for name, module in model.named_modules()] + [name for name, _ in model.named_parameters()]


@pytest.fixture(scope="module")
def inputs(tiny_model):
    return example_inputs(tiny_model.config, 2, 3, seed=13)


@pytest.fixture(scope="module")
def plain(tiny_model):
    return Sam3Grounding(copy.deepcopy(tiny_model)).eval()


@pytest.mark.parametrize("names", [(name,) for name in REGISTRY] + [tuple(REGISTRY)], ids=[*REGISTRY, "all"])
def test_each_alone_and_all_together_compute_what_transformers_does(tiny_model, inputs, plain, names):
    """Each optimization changes the model (a class, an attention or a parameter swapped in), and its outputs,
    and those of each part it changes or reads, are transformers' (the Triton ops through their reference on
    the CPU; test_kernels.py checks the kernels against it)."""
    fast = Sam3Grounding(copy.deepcopy(tiny_model), optimizations=names).eval()
    assert _shape_of(fast.model) != _shape_of(plain.model)
    images, token_ids = inputs
    with torch.no_grad():
        want, got = plain(images, token_ids), fast(images, token_ids)
        for name, g, w in zip(OUTPUTS, got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=lambda m: f"{names}: {name}: {m}")
        encoded = Part(fast, "encode_image")(images), Part(fast, "encode_text")(token_ids)
        for g, w in zip(Part(fast, "decode")(*encoded[0][:DECODE_IMAGE_INPUTS], *encoded[1]), got):
            assert torch.equal(g, w)

def test_all_of_them_together_run_the_projects_ops(tiny_model):
    """All together, the box-bias MLPs go through the op `sam3_aoti::box_bias_mlp` and the ViT's attentions, the DETR
    encoder's self-attentions and the decoder's box-biased cross-attentions through `sam3_aoti::attention` (each call
    counted), and the outputs are transformers'. A box bias or an attention off by 0.1 % moves them, so the
    comparison sees both ops."""
    import sam3_aoti.runtime.attention as attention
    import sam3_aoti.runtime.box_bias as box_bias

    images, token_ids = example_inputs(tiny_model.config, 2, 3, seed=13)
    plain = Sam3Grounding(copy.deepcopy(tiny_model)).eval()
    fast = Sam3Grounding(copy.deepcopy(tiny_model), optimizations=OPTIMIZATIONS).eval()
    model = fast.model
    calls = []
    layers, sdpa = box_bias.linear_layers, attention.reference
    with torch.no_grad():
        want = plain(images, token_ids)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(box_bias, "linear_layers", lambda *args: calls.append("mlp") or layers(*args))
            patch.setattr(attention, "reference", lambda *args: calls.append(args[4] is not None) or sdpa(*args))
            got = fast(images, token_ids)
            patch.setattr(box_bias, "linear_layers", lambda *args: layers(*args) * 1.001)
            patch.setattr(attention, "reference", sdpa)
            off_bias = fast(images, token_ids)
            patch.setattr(box_bias, "linear_layers", layers)
            patch.setattr(attention, "reference", lambda *args: sdpa(*args) * 1.001)
            off_attention = fast(images, token_ids)
    decoder_layers, encoder_layers = len(model.detr_decoder.layers), len(model.detr_encoder.layers)
    vit_layers = len(model.vision_encoder.backbone.layers)
    assert calls.count("mlp") == 2 * decoder_layers  # the x and y MLPs of every layer
    assert calls.count(True) == decoder_layers and calls.count(False) == encoder_layers + vit_layers  # biased, plain
    for name, g, w in zip(("logits", "boxes", "masks", "presence"), got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=name)
    for off in (off_bias, off_attention):
        assert any(float((o - w).abs().max()) > 1e-5 for o, w in zip(off, want))
    with pytest.raises(ValueError, match="unknown optimizations"):
        Sam3Grounding(copy.deepcopy(tiny_model), optimizations=("fast",))


def test_a_group_norm_reduced_per_channel_first_is_torchs():
    """`group_norm_by_channel` equals `nn.GroupNorm` in pixel order and in phase layout, on maps whose mean (100)
    is far from zero against their spread (0.7), where `E[x^2] - E[x]^2` in fp32 loses the variance, and in
    bf16 it is as close to the fp64 result as torch's own bf16 group norm."""
    from sam3_aoti.model.optimizations.group_norm_by_channel import (
        ChannelStatsGroupNorm,
    )

    torch.manual_seed(0)
    for shape in [(2, 16, 9, 7), (3, 16, 2, 2, 5, 6), (1, 16, 1, 1)]:
        norm = torch.nn.GroupNorm(4, 16).double()
        with torch.no_grad():
            norm.weight.normal_(), norm.bias.normal_()
        ours = copy.deepcopy(norm)
        ours.__class__ = ChannelStatsGroupNorm
        channel_offsets = torch.randn(1, 16, *[1] * (len(shape) - 2), dtype=torch.float64) * 0.5
        x = torch.randn(shape, dtype=torch.float64) * 0.5 + channel_offsets + 100
        with torch.no_grad():
            want = norm(x)
            torch.testing.assert_close(ours(x), want, atol=1e-10, rtol=1e-10)
            torch.testing.assert_close(ours.float()(x.float()).double(), want, atol=2e-4, rtol=1e-4)
            theirs_bf16 = (norm.bfloat16()(x.bfloat16()).double() - want).abs().max()
            ours_bf16 = (ours.bfloat16()(x.bfloat16()).double() - want).abs().max()
            assert ours_bf16 <= 1.5 * theirs_bf16 + 1e-2, (ours_bf16, theirs_bf16)


def test_a_convolution_after_nearest_upsampling_is_four_coarse_ones():
    """`phase_conv` (`pixel_decoder_per_image`) is the 3 x 3 convolution of the 2x nearest-upsampled map in phase
    layout, borders included, on non-square maps of odd and even sides; `from_phases` undoes `to_phases`."""
    import torch.nn.functional as F

    from sam3_aoti.model.optimizations.pixel_decoder_per_image import (
        from_phases,
        phase_conv,
        to_phases,
    )

    torch.manual_seed(0)
    for shape in [(2, 5, 6, 7), (1, 3, 1, 4), (3, 8, 9, 9)]:
        x = torch.randn(shape, dtype=torch.float64)
        weight = torch.randn(4, shape[1], 3, 3, dtype=torch.float64)
        want = F.conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), weight, padding=1)
        got = phase_conv(x, weight)
        assert got.shape == (shape[0], 4, 2, 2, *shape[2:])
        torch.testing.assert_close(from_phases(got), want, atol=1e-12, rtol=1e-12)
        assert torch.equal(to_phases(want)[:, :, 1, 0], want[:, :, 1::2, 0::2])  # phase (a, b): pixel (2h + a, 2w + b)
        assert torch.equal(from_phases(to_phases(want)), want)


def test_the_window_order_partitions_the_vits_tokens_once_a_call(tiny_model, inputs):
    """`vit_window_order`: one window partition a call, after the ViT's first LayerNorm, where transformers has one
    in each windowed layer; a ViT whose grid the windows do not tile keeps transformers' order."""
    from transformers.models.sam3 import modeling_sam3

    from sam3_aoti.model.optimizations import vit_window_order

    def partitions(model) -> int:
        calls = []
        with pytest.MonkeyPatch.context() as patch, torch.no_grad():
            for module in (modeling_sam3, vit_window_order):
                real = module.window_partition
                patch.setattr(module, "window_partition", lambda *a, real=real: calls.append(1) or real(*a))
            model(*inputs)
        return len(calls)

    vit = tiny_model.vision_encoder.backbone
    windowed = sum(1 for layer in vit.layers if layer.window_size)
    assert windowed >= 2 and partitions(Sam3Grounding(copy.deepcopy(tiny_model)).eval()) == windowed
    assert partitions(Sam3Grounding(copy.deepcopy(tiny_model), optimizations=("vit_window_order",)).eval()) == 1
    untiled = copy.deepcopy(tiny_model)
    untiled.vision_encoder.backbone.config.window_size = 3  # 8 x 8 patches
    REGISTRY["vit_window_order"].apply(untiled)
    assert type(untiled.vision_encoder.backbone) is modeling_sam3.Sam3ViTModel


def test_the_per_image_pixel_decoder_convolves_each_image_once_in_encode_image(tiny_model):
    """With `pixel_decoder_per_image`, encode_image hands decode the pixel decoder's convolutions of the finer
    levels (`laterals`, phase layout), decode on them is the whole model, prompt by prompt too, and the part that
    exports encode_image holds those convolutions (its pruned model would otherwise fail the call)."""
    from sam3_aoti.model.grounding import Part
    from sam3_aoti.model.optimizations.pixel_decoder_per_image import to_phases
    from sam3_aoti.model.section_calls import record_section_calls

    wrapper = Sam3Grounding(copy.deepcopy(tiny_model), optimizations=("pixel_decoder_per_image",)).eval()
    convs = wrapper.model.mask_decoder.pixel_decoder.conv_layers
    images, token_ids = example_inputs(tiny_model.config, 2, 3, seed=3)
    with torch.no_grad():
        encoded = wrapper.encode_image(images)
        vision = wrapper.model.get_vision_features(pixel_values=images)
        level0, level1 = vision.fpn_hidden_states[:2]
        torch.testing.assert_close(encoded[0], to_phases(convs[1](level0)))
        torch.testing.assert_close(encoded[1], to_phases(convs[0](level1)))
        for got, want in zip(Part(wrapper, "encode_image")(images), encoded):
            assert torch.equal(got, want)
        text = wrapper.encode_text(token_ids)
        whole = wrapper(images, token_ids)
        for got, want in zip(wrapper.decode(*encoded[:DECODE_IMAGE_INPUTS], *text), whole):
            assert torch.equal(got, want)
        last = wrapper.decode(*encoded[:DECODE_IMAGE_INPUTS], *(t[2:] for t in text))  # the third prompt alone
        for got, want in zip(last, whole):
            torch.testing.assert_close(got, want.unflatten(0, (2, 3))[:, 2], atol=1e-5, rtol=1e-4)
    sections = record_section_calls(wrapper, images, token_ids)
    assert len(sections["mask decoder"].calls) == 2  # the laterals per image, then the heads per pair
    with torch.no_grad():
        laterals, masks = sections["mask decoder"].run()
    assert torch.equal(laterals[0], encoded[0])


@pytest.mark.slow  # torch.export of the whole model
def test_the_per_image_pixel_decoder_exports_without_layout_dependent_views(tiny_model):
    """torch.export drops a `.contiguous()` whose input was contiguous at trace time, so an `as_strided` after
    it reads whatever layout the kernel returns at run time: with the phases as such a view, the exported
    program drifted from eager by 0.49 on the H200 (benchmarks/README.md). The phases are slices; the program
    holds no `as_strided`, and it equals eager at a shape other than the trace's."""
    from sam3_aoti.model.exporting import export_model

    wrapper = Sam3Grounding(copy.deepcopy(tiny_model), optimizations=("pixel_decoder_per_image",)).eval()
    program = export_model(wrapper, example_inputs(tiny_model.config, 2, 3))
    assert not [n for n in program.graph.nodes if "as_strided" in str(n.target)]
    images, token_ids = example_inputs(tiny_model.config, 3, 1, seed=4)
    with torch.no_grad():
        for got, want in zip(program.module()(images, token_ids), wrapper(images, token_ids)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
