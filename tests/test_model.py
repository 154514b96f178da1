"""The export wrapper (model/grounding.py, export_fixes.py, mixed_precision.py): pairing order, box conventions,
the empty geometric prompt, masked attention, the precision recipe, dynamic shapes after export."""

import copy

import pytest
import torch

from sam3_aoti.model.configs import example_inputs
from sam3_aoti.model.export_fixes import DENSE_MASK_SDPA, dense_mask
from sam3_aoti.model.exporting import export_model, export_transforms
from sam3_aoti.model.grounding import ImageTransforms, Sam3Grounding


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
    from sam3_aoti.model.configs import full_config

    assert full_config().vision_config.backbone_config.layer_norm_eps == 1e-5  # Meta's ViT LayerNorm


def test_different_prompts_give_different_outputs(wrapper, tiny_model):
    """Guards the pairing test itself: if prompts were ignored, it could pass by accident."""
    images, token_ids = example_inputs(tiny_model.config, 1, 2, seed=5)
    with torch.no_grad():
        logits = wrapper(images, token_ids)[0]
    assert not torch.allclose(logits[0], logits[1])


@pytest.mark.slow  # torch.export of the whole model
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
    from sam3_aoti.model.mixed_precision import BOX_PATH_FP32_LINEARS

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

