"""The export wrapper: pairing order, box conventions, dynamic shapes after export."""

import copy

import pytest
import torch

from sam3_aoti.stages.export import export_model, export_transforms
from sam3_aoti.model.wrapper import DENSE_MASK_SDPA, ImageTransforms, Sam3Grounding, dense_mask, example_inputs


@pytest.fixture(scope="module")
def wrapper(tiny_model):
    return Sam3Grounding(tiny_model).eval()


def test_pair_i_is_image_i_div_p_with_prompt_i_mod_p(wrapper, tiny_model):
    images, token_ids = example_inputs(tiny_model.config, 2, 3, seed=5)
    with torch.no_grad():
        batched = wrapper(images, token_ids)
        for i in range(6):
            b, p = divmod(i, 3)
            single = wrapper(images[b : b + 1], token_ids[p : p + 1])
            for got, want in zip(batched, single):
                torch.testing.assert_close(got[i], want[0], atol=1e-5, rtol=1e-4)  # SDPA blocks differ per batch size


def test_the_wrapper_is_transformers_sam3model_with_the_empty_geometric_prompt(wrapper):
    """What the wrapper changes in how Sam3Model runs changes no output: the DETR encoder's first
    self-attention once per image instead of per pair, only the last decoder layer scored, boxes kept
    cxcywh. The reference is `Sam3Model.forward` itself on a fresh copy of the model, fed the per-pair
    vision features and the prompt with Meta's empty geometric prompt appended (as the wrapper appends it)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling
    from transformers.models.sam3.modeling_sam3 import Sam3VisionEncoderOutput

    from sam3_aoti.model.checkpoints import build_model
    from sam3_aoti.pipeline.settings import load_settings

    plain = build_model(load_settings(device="cpu")).eval()
    batch, prompts = 2, 3
    images, token_ids = example_inputs(plain.config, batch, prompts, seed=3)
    mask = (token_ids != 0).long()
    with torch.no_grad():
        ours = wrapper(images, token_ids)
        vision = plain.get_vision_features(pixel_values=images)
        geometry = wrapper.empty_geometry_prompt(vision)
        text = plain.get_text_features(input_ids=token_ids, attention_mask=mask).pooler_output
        pairs = [f.repeat_interleave(prompts, dim=0) for f in vision.fpn_hidden_states]
        position = [p.repeat_interleave(prompts, dim=0) for p in vision.fpn_position_encoding]
        out = plain(vision_embeds=Sam3VisionEncoderOutput(fpn_hidden_states=pairs, fpn_position_encoding=position),
                    text_embeds=BaseModelOutputWithPooling(
                        pooler_output=torch.cat([text.repeat(batch, 1, 1), geometry.repeat_interleave(prompts, 0)], 1)),
                    attention_mask=torch.cat([mask.repeat(batch, 1), mask.new_ones(batch * prompts, 1)], dim=1))
    x1, y1, x2, y2 = out.pred_boxes.unbind(-1)
    theirs = (out.pred_logits.unsqueeze(-1), torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], -1),
              out.pred_masks, out.presence_logits)
    for name, got, want in zip(("logits", "boxes", "masks", "presence"), ours, theirs):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_text_prompts_carry_the_empty_geometric_prompt_as_metas_sam3_does(wrapper, tiny_model):
    """transformers' text-only forward skips the geometry encoder; Meta's appends its CLS token (and the
    H200 parity run matches Meta only with it). Changing that token must change the outputs."""
    images, token_ids = example_inputs(tiny_model.config, 1, 2, seed=5)
    ids = token_ids[:1]
    with torch.no_grad():
        ours = wrapper(images, ids)[0][0, :, 0]
        text_only = tiny_model(pixel_values=images, input_ids=ids, attention_mask=(ids != 0).long()).pred_logits[0]
        assert not torch.allclose(ours, text_only, atol=1e-4)
        cls = tiny_model.geometry_encoder.cls_embed.weight
        saved = cls.clone()
        cls.add_(1.0)
        changed = wrapper(images, ids)[0][0, :, 0]
        cls.copy_(saved)
    assert not torch.allclose(ours, changed, atol=1e-4)


def test_masked_attention_runs_on_sdpa_and_the_vit_keeps_plain_sdpa(wrapper):
    model = wrapper.model
    assert model.detr_decoder.layers[0].text_cross_attn.config._attn_implementation == DENSE_MASK_SDPA
    assert model.geometry_encoder.layers[0].cross_attn.config._attn_implementation == DENSE_MASK_SDPA
    assert model.detr_encoder.layers[0].cross_attn.config._attn_implementation == DENSE_MASK_SDPA
    assert model.text_encoder.text_model.encoder.layers[0].self_attn.config._attn_implementation == DENSE_MASK_SDPA
    assert model.vision_encoder.backbone.layers[0].attention.config._attn_implementation == "sdpa"
    assert model.detr_encoder.layers[0].self_attn.config._attn_implementation == "sdpa"  # 5184 tokens, no mask


def test_dense_mask_is_additive_contiguous_with_rows_aligned_to_8():
    keep = torch.rand(2, 1, 1, 33) > 0.3  # a padding mask, broadcast over the queries
    keep[..., 0] = True
    mask = dense_mask(keep, torch.bfloat16, 5, 33)
    assert mask.shape == (2, 1, 5, 33) and mask.dtype == torch.bfloat16
    assert mask.stride(-1) == 1 and mask.stride(-2) == 40 and all(s % 8 == 0 for s in mask.stride()[:-1])
    assert bool((mask[keep.expand(2, 1, 5, 33)] == 0).all())
    assert bool((mask[~keep.expand(2, 1, 5, 33)] == torch.finfo(torch.bfloat16).min).all())
    bias = torch.randn(2, 4, 17, 64)  # a float bias (the DETR decoder's box bias) keeps its values
    dense = dense_mask(bias, torch.float32, 17, 64)
    assert torch.equal(dense, bias) and dense.stride(-2) == 64


def test_sdpa_masked_attention_equals_transformers_eager(wrapper, tiny_model):
    """The package's masked attentions (SDPA on a dense mask; the text encoder causal) against transformers'
    own matmul-softmax, on prompts of several lengths (padding masked). The export test below checks that
    the exported program keeps them on SDPA."""
    images, token_ids = example_inputs(tiny_model.config, 2, 3, seed=4)
    eager = Sam3Grounding(copy.deepcopy(tiny_model), masked_attention="eager").eval()
    with torch.no_grad():
        for got, want in zip(wrapper(images, token_ids), eager(images, token_ids)):
            torch.testing.assert_close(got, want, atol=1e-5 + 1e-5 * float(want.abs().max()), rtol=0)


def test_full_config_is_metas_architecture():
    from sam3_aoti.model.wrapper import full_config

    assert full_config().vision_config.backbone_config.layer_norm_eps == 1e-5  # Meta's ViT LayerNorm


def test_different_prompts_give_different_outputs(wrapper, tiny_model):
    """Guards the pairing test itself: if prompts were ignored, it could pass by accident."""
    images, token_ids = example_inputs(tiny_model.config, 1, 2, seed=5)
    with torch.no_grad():
        logits = wrapper(images, token_ids)[0]
    assert not torch.allclose(logits[0], logits[1])


def test_exported_program_runs_at_every_batch_and_prompt_count(wrapper, tiny_model):
    program = export_model(wrapper, example_inputs(tiny_model.config, 2, 3))
    assert [n for n in program.graph.nodes if "softmax" in str(n.target)] == []  # every attention one SDPA call
    queries = tiny_model.config.detr_decoder_config.num_queries
    with torch.no_grad():
        for b, p in [(1, 1), (1, 4), (3, 1), (3, 4), (2, 3)]:
            args = example_inputs(tiny_model.config, b, p, seed=b + 7 * p)
            got, want = program.module()(*args), wrapper(*args)
            assert got[0].shape == (b * p, queries, 1)
            assert got[2].shape == (b * p, queries, 32, 32)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_transforms_resize_any_image_to_the_model_input():
    module = ImageTransforms(112)
    program = export_transforms(module, torch.rand(2, 3, 200, 300) * 255)
    for shape in [(1, 3, 97, 150), (3, 3, 640, 480)]:
        x = torch.rand(*shape) * 255
        out = program.module()(x)
        assert out.shape == (shape[0], 3, 112, 112)
        torch.testing.assert_close(out, module(x))
    flat = program.module()(torch.full((1, 3, 50, 60), 255.0))
    torch.testing.assert_close(flat, torch.ones(1, 3, 112, 112))  # 255 -> 1.0 -> (1 - 0.5) / 0.5


def test_bf16_keeps_the_box_path_in_fp32_and_boxes_closer_to_fp32(tiny_model):
    """bf16 holds a box coordinate to 1/256 at each of the decoder's refinement steps; with the decoder and
    the scoring in fp32 (FP32_IN_BF16) the boxes of a bf16 model land nearer the fp32 model's."""
    from sam3_aoti.runtime.contract import FP32_IN_BF16

    images, token_ids = example_inputs(tiny_model.config, 2, 3, seed=11)
    mixed_model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        reference = Sam3Grounding(copy.deepcopy(tiny_model)).eval()(images, token_ids)
        mixed = Sam3Grounding(mixed_model, torch.bfloat16).eval()(images, token_ids)
        plain = Sam3Grounding(copy.deepcopy(tiny_model), torch.bfloat16, fp32_parts=()).eval()(images, token_ids)
    assert {p.dtype for name in FP32_IN_BF16 for p in getattr(mixed_model, name).parameters()} == {torch.float32}
    assert mixed_model.vision_encoder.backbone.layers[0].mlp.fc1.weight.dtype == torch.bfloat16
    box_error = lambda out: float((out[1] - reference[1]).abs().max())  # noqa: E731
    assert box_error(mixed) < box_error(plain)


def test_a_bf16_build_can_run_the_decoders_attentions_in_bf16_and_keep_its_box_path_fp32(tiny_model):
    """`box_path_attention = "bf16"`: the DETR decoder's weights and box refinement stay fp32, its three
    attentions per layer take bf16 inputs (what the fast kernels take), and the boxes stay near the fp32
    decoder's."""
    from transformers.models.sam3.modeling_sam3 import Sam3Attention

    images, token_ids = example_inputs(tiny_model.config, 1, 2, seed=11)
    fast_model = copy.deepcopy(tiny_model)
    seen = []
    with torch.no_grad():
        fp32_attention = Sam3Grounding(copy.deepcopy(tiny_model), torch.bfloat16).eval()(images, token_ids)
        fast = Sam3Grounding(fast_model, torch.bfloat16, box_path_attention="bf16").eval()
        attentions = [m for m in fast_model.detr_decoder.modules() if isinstance(m, Sam3Attention)]
        real_sdpa = torch.nn.functional.scaled_dot_product_attention
        decoder_queries = tiny_model.config.detr_decoder_config.num_queries + 1  # + the presence token

        def spy(q, k, v, **kwargs):
            if q.shape[2] == decoder_queries:
                seen.append(q.dtype)
            return real_sdpa(q, k, v, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = spy
        try:
            out = fast(images, token_ids)
        finally:
            torch.nn.functional.scaled_dot_product_attention = real_sdpa
    assert len(attentions) == 3 * len(fast_model.detr_decoder.layers)
    assert {a.attention_dtype for a in attentions} == {torch.bfloat16}
    assert fast_model.detr_decoder.layers[0].mlp.fc1.weight.dtype == torch.float32  # the decoder stays fp32
    assert seen == [torch.bfloat16] * len(attentions) and all(t.isfinite().all() for t in out)
    box_gap = float((out[1] - fp32_attention[1]).abs().max())
    assert 0 < box_gap < 2e-2, box_gap


def test_a_bf16_build_can_run_the_decoders_linears_as_bf16_gemms_around_an_fp32_box_path(tiny_model):
    """`box_path_linears = "bf16"`: every linear of the DETR decoder but its box and presence heads stores bf16
    weights and runs a bf16 GEMM between fp32 activations (Meta's autocast recipe); the layer norms, the heads
    and the box refinement stay fp32, and the boxes stay near the fp32 decoder's."""
    from sam3_aoti.model.wrapper import BOX_PATH_FP32_LINEARS

    images, token_ids = example_inputs(tiny_model.config, 1, 2, seed=11)
    model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        fp32_linears = Sam3Grounding(copy.deepcopy(tiny_model), torch.bfloat16, box_path_attention="bf16").eval()
        fast = Sam3Grounding(model, torch.bfloat16, box_path_attention="bf16", box_path_linears="bf16").eval()
        reference, out = fp32_linears(images, token_ids), fast(images, token_ids)
    decoder = model.detr_decoder
    linears = {name: m for name, m in decoder.named_modules() if isinstance(m, torch.nn.Linear)}
    kept = {name for name in linears if name.split(".")[0] in BOX_PATH_FP32_LINEARS}
    assert kept and {linears[n].weight.dtype for n in kept} == {torch.float32}
    assert {m.weight.dtype for n, m in linears.items() if n not in kept} == {torch.bfloat16}
    assert decoder.layers[0].mlp.fc1.weight.dtype == torch.bfloat16 and decoder.box_rpb_embed_x.layer1.weight.dtype \
        == torch.bfloat16
    assert {p.dtype for name, p in decoder.named_parameters() if "norm" in name} == {torch.float32}
    assert all(o.dtype == torch.float32 and o.isfinite().all() for o in out)
    box_gap = float((out[1] - reference[1]).abs().max())
    assert 0 < box_gap < 2e-2, box_gap


def test_the_optimizations_compute_what_transformers_does(tiny_model):
    """`[export] optimizations`: each swaps in its code (the box-bias MLPs through the op `sam3_aoti::box_bias_mlp`,
    the DETR encoder's MLPs as GEMMs with a ReLU epilogue, its self-attentions and the decoder's box-biased
    cross-attentions through the op `sam3_aoti::attention`, the decoder's keys and values projected for all
    layers at once, the pixel decoder's convolutions split into per-image and per-pair halves, the text
    encoder's query, key and value projections as one GEMM), and together, and the last four alone, they give
    transformers' outputs. A box bias or an
    attention off by 0.1 % moves them, so the comparison sees both ops."""
    import sam3_aoti.runtime.attention as attention
    import sam3_aoti.runtime.box_bias as box_bias
    from sam3_aoti.model.wrapper import (_ChannelStatsGroupNorm, _FusedQKVTextAttention, _GridBiasAttention,
                                         _PerImageMaskDecoder, _ReluEpilogueMLP, _SharedProjectionsDecoderLayer)
    from sam3_aoti.pipeline.schema import OPTIMIZATIONS

    images, token_ids = example_inputs(tiny_model.config, 2, 3, seed=13)
    plain = Sam3Grounding(copy.deepcopy(tiny_model)).eval()
    fast = Sam3Grounding(copy.deepcopy(tiny_model), optimizations=OPTIMIZATIONS).eval()
    model = fast.model
    mlps = [layer.mlp for layer in model.detr_encoder.layers]
    assert mlps and all(type(mlp) is _ReluEpilogueMLP for mlp in mlps)
    assert all(type(layer.vision_cross_attn) is _GridBiasAttention for layer in model.detr_decoder.layers)
    assert all(type(layer) is _SharedProjectionsDecoderLayer and not hasattr(layer.vision_cross_attn, "k_proj")
               and not hasattr(layer.self_attn, "q_proj") for layer in model.detr_decoder.layers)
    assert type(model.mask_decoder) is _PerImageMaskDecoder
    assert all(type(norm) is _ChannelStatsGroupNorm for norm in model.mask_decoder.pixel_decoder.norms)
    text_attentions = [layer.self_attn for layer in model.text_encoder.text_model.encoder.layers]
    assert text_attentions and all(type(a) is _FusedQKVTextAttention and not hasattr(a, "q_proj")
                                   for a in text_attentions)
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
    assert calls.count("mlp") == 2 * decoder_layers  # the x and y MLPs of every layer
    assert calls.count(True) == decoder_layers and calls.count(False) == encoder_layers  # biased, plain
    for name, g, w in zip(("logits", "boxes", "masks", "presence"), got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=name)
    for off in (off_bias, off_attention):
        assert any(float((o - w).abs().max()) > 1e-5 for o, w in zip(off, want))
    for optimization in ("grid_bias_attention", "decoder_shared_projections", "pixel_decoder_per_image",
                         "text_fused_qkv", "group_norm_by_channel"):
        # the tables from transformers' own MLPs (no box_bias_kernel); the stacked projections with SDPA's bias
        alone = Sam3Grounding(copy.deepcopy(tiny_model), optimizations=(optimization,)).eval()
        with torch.no_grad():
            for name, g, w in zip(("logits", "boxes", "masks", "presence"), alone(images, token_ids), want):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4, msg=f"{optimization}: {name}")
    with pytest.raises(ValueError, match="unknown optimizations"):
        Sam3Grounding(copy.deepcopy(tiny_model), optimizations=("fast",))


def test_a_group_norm_reduced_per_channel_first_is_torchs():
    """`group_norm_by_channel` equals `nn.GroupNorm` in pixel order and in phase layout, on maps whose mean (100)
    is far from zero against their spread (0.7), where `E[x^2] - E[x]^2` in fp32 loses the variance, and in
    bf16 it is as close to the fp64 result as torch's own bf16 group norm."""
    from sam3_aoti.model.wrapper import _ChannelStatsGroupNorm

    torch.manual_seed(0)
    for shape in [(2, 16, 9, 7), (3, 16, 2, 2, 5, 6), (1, 16, 1, 1)]:
        norm = torch.nn.GroupNorm(4, 16).double()
        with torch.no_grad():
            norm.weight.normal_(), norm.bias.normal_()
        ours = copy.deepcopy(norm)
        ours.__class__ = _ChannelStatsGroupNorm
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

    from sam3_aoti.model.wrapper import from_phases, phase_conv, to_phases

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


def test_the_per_image_pixel_decoder_convolves_each_image_once_in_encode_image(tiny_model):
    """With `pixel_decoder_per_image`, encode_image hands decode the pixel decoder's convolutions of the finer
    levels (`laterals`, phase layout), decode on them is the whole model, prompt by prompt too, and the part that
    exports encode_image holds those convolutions (its pruned model would otherwise fail the call)."""
    from sam3_aoti.model.part_calls import record_part_calls
    from sam3_aoti.model.wrapper import Part, to_phases

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
        for got, want in zip(wrapper.decode(*encoded, *text), whole):
            assert torch.equal(got, want)
        last = wrapper.decode(*encoded, *(t[2:] for t in text))  # the third prompt alone
        for got, want in zip(last, whole):
            torch.testing.assert_close(got, want.unflatten(0, (2, 3))[:, 2], atol=1e-5, rtol=1e-4)
    parts = record_part_calls(wrapper, images, token_ids)
    assert len(parts["mask decoder"].calls) == 2  # the laterals per image, then the heads per pair
    with torch.no_grad():
        laterals, masks = parts["mask decoder"].run()
    assert torch.equal(laterals[0], encoded[0])


def test_the_per_image_pixel_decoder_exports_without_layout_dependent_views(tiny_model):
    """torch.export drops a `.contiguous()` whose input was contiguous at trace time, so an `as_strided` after
    it reads whatever layout the kernel returns at run time: with the phases as such a view, the exported
    program drifted from eager by 0.49 on the H200 (benchmarks/README.md). The phases are slices; the program
    holds no `as_strided`, and it equals eager at a shape other than the trace's."""
    from sam3_aoti.stages.export import export_model

    wrapper = Sam3Grounding(copy.deepcopy(tiny_model), optimizations=("pixel_decoder_per_image",)).eval()
    program = export_model(wrapper, example_inputs(tiny_model.config, 2, 3))
    assert not [n for n in program.graph.nodes if "as_strided" in str(n.target)]
    images, token_ids = example_inputs(tiny_model.config, 3, 1, seed=4)
    with torch.no_grad():
        for got, want in zip(program.module()(images, token_ids), wrapper(images, token_ids)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


TRITON_KERNEL_CHECK = """
import torch
from transformers.models.sam3.modeling_sam3 import Sam3DecoderMLP
from sam3_aoti.runtime.box_bias import launch_box_bias
torch.manual_seed(0)
for hidden, heads in [(32, 2), (256, 8), (48, 3)]:
    mlp = Sam3DecoderMLP(2, hidden, heads, 2)
    for p in mlp.parameters():
        p.data.normal_()
    deltas = torch.randn(3, 5, 7, 2)
    got = launch_box_bias(deltas, mlp.layer1.weight, mlp.layer1.bias, mlp.layer2.weight, mlp.layer2.bias)
    with torch.no_grad():
        torch.testing.assert_close(got, mlp(deltas).permute(0, 3, 1, 2), atol=1e-4, rtol=1e-5)
print("ok")
"""


def test_the_box_bias_kernel_is_the_mlp_in_tritons_interpreter():
    """The Triton kernel of the op `sam3_aoti::box_bias_mlp`, run by Triton's CPU interpreter (`TRITON_INTERPRET=1`), gives the
    MLP's output in `[N, heads, Q, side]` for widths that are and are not powers of two (fp32 weights: the
    interpreter's bf16 dot is wrong; tests/test_gpu.py checks bf16 on CUDA)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", TRITON_KERNEL_CHECK], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_bench_counts_the_flops_inside_the_projects_ops():
    """bench's FLOPs per part (FlopCounterMode) see an op of the project as one call: each registers its count,
    attention as SDPA's (4 B H Lq Lk D) and the box-bias MLP as its two linear layers'."""
    import sam3_aoti.runtime.box_bias as box_bias
    from torch.utils.flop_counter import FlopCounterMode

    def counted(fn, *args) -> int:
        counter = FlopCounterMode(display=False)
        with counter:
            fn(*args)
        return counter.get_total_flops()

    q, k, v = torch.randn(2, 4, 40, 16), torch.randn(2, 4, 64, 16), torch.randn(2, 4, 64, 16)
    tables = torch.randn(2, 4, 40, 8), torch.randn(2, 4, 40, 8)
    assert counted(torch.ops.sam3_aoti.attention, q, k, v, 0.25, *tables) == 4 * 2 * 4 * 40 * 64 * 16
    mlp = torch.randn(2, 5, 7, 2), torch.randn(32, 2), torch.randn(32), torch.randn(4, 32), torch.randn(4)
    assert counted(torch.ops.sam3_aoti.box_bias_mlp, *mlp) == counted(box_bias.linear_layers, *mlp) > 0


def test_bench_counts_the_weights_a_part_reads_once_each(wrapper, tiny_model):
    """bench's floor per part reads each weight once: a call through two of three linears reads those two (a
    transpose or slice of a weight counts as the weight, a weight used twice once, an embedding table the rows
    looked up); a model part reads what its modules hold (the ViT all of its weights), and together no more
    than the model holds."""
    from sam3_aoti.model.part_calls import MODEL_PARTS, record_part_calls
    from sam3_aoti.stages.bench import flops_and_weights_of

    layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
    per_linear = (8 * 8 + 8) * 4
    x = torch.randn(2, 8)
    through_two = lambda: layers[1](layers[0](x)) + (x @ layers[0].weight.t()[:, :4]).sum()  # noqa: E731
    _, read = flops_and_weights_of(layers, (), through_two)
    assert read == 2 * per_linear
    table = torch.nn.Embedding(100, 8)
    _, read = flops_and_weights_of(table, (torch.tensor([[3, 5, 3], [7, 0, 0]]),))
    assert read == 4 * 8 * 4  # the four distinct rows looked up, not the table
    images, token_ids = example_inputs(tiny_model.config, 1, 2, seed=7)
    parts = record_part_calls(wrapper, images, token_ids)
    reads = {name: flops_and_weights_of(wrapper, (), parts[name].run)[1] for name in MODEL_PARTS}
    vit = tiny_model.vision_encoder
    weights, buffers = (sum(t.nbytes for t in ts) for ts in (vit.parameters(), vit.buffers()))
    assert weights <= reads["ViT"] <= weights + buffers  # every weight (and the buffers it uses: not RoPE's spare)
    assert all(reads[name] > 0 for name in MODEL_PARTS)
    everything = sum(t.untyped_storage().nbytes() for t in (*wrapper.parameters(), *wrapper.buffers()))
    assert sum(reads.values()) <= everything
    _, whole = flops_and_weights_of(wrapper, (images, token_ids))
    assert whole <= sum(reads.values())  # every weight the whole call reads, some part reads


ATTENTION_KERNEL_CHECK = """
import torch
from sam3_aoti.runtime.attention import launch_attention, reference
torch.manual_seed(0)
# (pairs, heads, queries, grid rows, grid side, head dim, config): uneven and even key blocks, a non-square grid
for n, h, lq, rows, side, d, config in [(2, 3, 37, 6, 8, 32, (16, 16, 4, 1)), (1, 2, 40, 3, 16, 16, (32, 16, 4, 1)),
                                        (2, 2, 64, 8, 8, 32, (32, 32, 4, 1)), (1, 2, 20, 9, 8, 32, (16, 64, 4, 1))]:
    q, k, v = (torch.randn(n, length, h, d).transpose(1, 2) for length in (lq, rows * side, rows * side))
    tables = torch.randn(n, h, lq, rows), torch.randn(n, h, lq, side)
    below_first = torch.randn(n, h, lq - 1, rows), torch.randn(n, h, lq - 1, side)  # row 0 unbiased
    for bias in (tables, below_first, (None, None)):
        got = launch_attention(q, k, v, 0.3, *bias, config=config)
        assert got.shape == (n, lq, h, d)
        torch.testing.assert_close(got, reference(q, k, v, 0.3, *bias), atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_the_attention_kernel_is_sdpa_in_tritons_interpreter():
    """The Triton kernel of the op `sam3_aoti::attention`, run by Triton's CPU interpreter, is SDPA on strided
    `[B, H, L, D]` views, with a grid bias from a non-square pair of tables (for every query, or for all but the
    first, as the decoder's presence token has it) and without one, for key lengths
    that are and are not a multiple of the key block (fp32: tests/test_gpu.py checks bf16 on CUDA)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", ATTENTION_KERNEL_CHECK], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_each_model_part_re_runs_alone_on_what_the_whole_call_gave_it(wrapper, tiny_model):
    """bench times the parts alone (model.part_calls): every part is found in one call, re-run alone gives what
    it gave inside the call, and the compiled re-run (what bench times) gives it too."""
    from sam3_aoti.model.part_calls import MODEL_PARTS, record_part_calls

    images, token_ids = example_inputs(tiny_model.config, 2, 3, seed=7)
    inside = {}
    hooks = [getattr(tiny_model, child).register_forward_hook(lambda m, i, out, c=child: inside.setdefault(c, out))
             for child in ("detr_decoder", "mask_decoder")]
    try:
        parts = record_part_calls(wrapper, images, token_ids)
    finally:
        for hook in hooks:
            hook.remove()
    assert list(parts) == list(MODEL_PARTS)
    # text: encoder and projection; DETR encoder: its per-image self-attention, then the encoder over the pairs
    assert [len(parts[name].calls) for name in MODEL_PARTS] == [1, 2, 1, 2, 1, 1, 1]
    with torch.no_grad():
        attended, _ = parts["DETR encoder"].run()
        assert torch.equal(attended, wrapper.encode_image(images)[2])
        decoded, = parts["DETR decoder"].run()
        masks, = parts["mask decoder"].run()
        geometry, = parts["geometry encoder"].run()
        assert torch.equal(decoded[0], inside["detr_decoder"][0])  # ModelOutputs: their first tensor
        assert torch.equal(masks[0], inside["mask_decoder"][0])
        assert torch.equal(geometry, wrapper.encode_image(images)[-1])
        compiled = parts["scoring"].compiled(torch.compile, {})
        assert torch.allclose(compiled.run()[0], parts["scoring"].run()[0], atol=1e-5)
