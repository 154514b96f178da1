"""The export wrapper: pairing order, box conventions, dynamic shapes after export."""

import pytest
import torch

from sam3_aoti.export import export_model, export_transforms
from sam3_aoti.model import ImageTransforms, Sam3Grounding, example_inputs


@pytest.fixture(scope="module")
def wrapper(tiny_model):
    return Sam3Grounding(tiny_model).eval()


def test_pair_i_is_image_i_div_p_with_prompt_i_mod_p(wrapper, tiny_model):
    images, token_ids = example_inputs(tiny_model.config, 2, 3, seed=5)
    with torch.no_grad():
        logits, boxes, masks, presence = wrapper(images, token_ids)
        for i in range(6):
            b, p = divmod(i, 3)
            ids = token_ids[p : p + 1]
            ref = tiny_model(pixel_values=images[b : b + 1], input_ids=ids, attention_mask=(ids != 0).long())
            torch.testing.assert_close(logits[i, :, 0], ref.pred_logits[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(masks[i], ref.pred_masks[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(presence[i], ref.presence_logits[0], atol=1e-5, rtol=1e-5)
            x1, y1, x2, y2 = ref.pred_boxes[0].unbind(-1)
            torch.testing.assert_close(boxes[i], torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], -1))


def test_different_prompts_give_different_outputs(wrapper, tiny_model):
    """Guards the pairing test itself: if prompts were ignored, it could pass by accident."""
    images, token_ids = example_inputs(tiny_model.config, 1, 2, seed=5)
    with torch.no_grad():
        logits = wrapper(images, token_ids)[0]
    assert not torch.allclose(logits[0], logits[1])


def test_exported_program_runs_at_every_batch_and_prompt_count(wrapper, tiny_model):
    program = export_model(wrapper, example_inputs(tiny_model.config, 2, 3))
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
