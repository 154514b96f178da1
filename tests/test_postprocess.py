"""Model outputs -> instances: the kept queries picked, resized and brought back together give what one
instance at a time gave (the form every earlier release computed), bit for bit and in the same order."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sam3_aoti.runtime import postprocess
from sam3_aoti.runtime.postprocess import instances, scores, to_tensor


def one_at_a_time(outputs, prompts, image_hw, image_index=0, threshold=0.5, top_k=None):
    """The reference: each kept instance picked, resized and copied to the host alone."""
    h, w = image_hw
    all_scores = scores(outputs)
    _, boxes, masks, _ = outputs
    found = []
    for p, prompt in enumerate(prompts):
        pair = image_index * len(prompts) + p
        s = all_scores[pair]
        picked = s.topk(min(top_k, s.numel())).indices if top_k else (s >= threshold).nonzero()[:, 0]
        for q in picked.tolist():
            cx, cy, bw, bh = boxes[pair, q].tolist()
            box = ((cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h)
            mask = F.interpolate(masks[pair, q][None, None].float(), size=(h, w), mode="bilinear")[0, 0] > 0
            found.append((prompt, q, float(s[q]), box, mask.numpy()))
    return sorted(found, key=lambda i: -i[2])


def random_outputs(images: int, prompts: int, queries: int = 16, side: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = images * prompts
    return (torch.randn(n, queries, 1, generator=g), torch.rand(n, queries, 4, generator=g) * 0.5 + 0.1,
            torch.randn(n, queries, side, side, generator=g), torch.randn(n, 1, generator=g))


@pytest.mark.parametrize("threshold, top_k, image_index, hw", [
    (0.5, None, 0, (97, 150)), (0.2, None, 2, (64, 64)), (0.05, None, 1, (300, 41)), (0.99, None, 0, (50, 50)),
    (0.5, 3, 1, (80, 120)), (0.5, 40, 0, (33, 33)),
])
def test_instances_of_one_image_are_the_one_at_a_time_instances(threshold, top_k, image_index, hw, monkeypatch):
    monkeypatch.setattr(postprocess, "MASK_BYTES", 4 * hw[0] * hw[1] * 3)  # resized three masks at a time
    prompts = ["a", "b", "c"]
    outputs = random_outputs(3, len(prompts), seed=image_index)
    got = instances(outputs, prompts, hw, image_index, threshold, top_k)
    want = one_at_a_time(outputs, prompts, hw, image_index, threshold, top_k)
    assert len(got) == len(want) and (len(want) > 0 or threshold > 0.9)
    for inst, (prompt, q, score, box, mask) in zip(got, want):
        assert (inst.prompt, inst.query, inst.score, inst.box_xyxy) == (prompt, q, score, box)
        assert inst.mask.dtype == np.bool_ and np.array_equal(inst.mask, mask)


def test_pixels_become_floats_on_the_device_unchanged():
    image = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    tensor = to_tensor(image)
    assert tensor.dtype == torch.float32 and tensor.shape == (1, 3, 5, 7) and tensor.is_contiguous()
    assert torch.equal(tensor, torch.from_numpy(image).permute(2, 0, 1)[None].float())


@pytest.mark.parametrize("threshold, hw", [(0.2, (97, 150)), (0.1, (40, 31))])
def test_masks_counted_into_runs_encode_as_pycocotools_encodes_the_whole_mask(threshold, hw):
    """What segment writes (runs counted where the masks are, then COCO's codec) is what pycocotools makes of
    the full mask, and the areas agree."""
    from pycocotools import mask as coco_mask

    from sam3_aoti.batch.worker import coco_rle

    prompts = ["a", "b"]
    outputs = random_outputs(2, len(prompts), seed=5)
    arrays = instances(outputs, prompts, hw, 1, threshold)
    runs = instances(outputs, prompts, hw, 1, threshold, as_runs=True)
    assert len(arrays) == len(runs) > 0
    for a, r in zip(arrays, runs):
        assert (a.prompt, a.query, a.score, a.box_xyxy, a.area) == (r.prompt, r.query, r.score, r.box_xyxy, r.area)
        assert r.mask is None and a.area == int(a.mask.sum())
        expected = coco_mask.encode(np.asfortranarray(a.mask.astype(np.uint8)))["counts"].decode("ascii")
        assert coco_rle(r.runs, *hw) == expected


def test_runs_of_empty_full_and_corner_masks():
    masks = torch.zeros(4, 3, 5, dtype=torch.bool)
    masks[1] = True
    masks[2, 0, 0] = True  # a run of 0 zeros first
    masks[3, :, 4] = True  # the last column
    runs, areas = postprocess.column_runs(masks)
    assert [r.tolist() for r in runs] == [[15], [0, 15], [0, 1, 14], [12, 3]]
    assert areas == [0, 15, 1, 3]
