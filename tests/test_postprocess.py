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


def images_of_sizes(*sizes):
    rng = np.random.default_rng(0)
    return [torch.from_numpy(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def test_images_of_one_size_are_transformed_in_one_call_each_as_alone():
    """Tiles of one size go to the device and through `transforms` together; each comes back where it was, as its
    own call gives it."""
    calls = []

    def transforms(batch):  # image by image, as the package's: resize and normalize
        calls.append(tuple(batch.shape))
        return F.interpolate(batch, size=(16, 16), mode="bilinear") / 127.5 - 1

    images = images_of_sizes((20, 30), (9, 12), (20, 30), (20, 30), (9, 12))
    got = postprocess.transformed(transforms, images)
    assert calls == [(3, 3, 20, 30), (2, 3, 9, 12)]
    want = torch.cat([transforms(to_tensor(image)) for image in images])
    assert torch.equal(got, want)


def test_the_packages_transforms_of_a_batch_of_one_size_are_each_images_own(package_path):
    from sam3_aoti.runtime.loader import load_package

    package = load_package(package_path)
    images = images_of_sizes((97, 150), (97, 150), (40, 31), (97, 150))
    with torch.inference_mode():
        got = postprocess.transformed(package.transforms, images)
        want = torch.cat([package.transforms(to_tensor(image)) for image in images])
    assert torch.equal(got, want)


@pytest.mark.parametrize("threshold, sizes, dtype", [
    (0.2, [(97, 150), (40, 31), (8, 9)], torch.float32),
    (0.1, [(33, 20), (64, 64)], torch.bfloat16),
    (0.99, [(10, 10)], torch.float32),  # nothing kept
])
def test_a_batch_gives_each_image_what_instances_gives_it_with_its_masks_as_pycocotools_encodes_them(
        threshold, sizes, dtype, monkeypatch):
    """segment's path (every image of the batch at once, masks packed into bits, then COCO counts on a CPU) is
    predict's (`instances`, one image at a time, whole masks) instance for instance, and its counts are
    pycocotools' encoding of predict's mask."""
    from pycocotools import mask as coco_mask

    from sam3_aoti.batch.worker import coco_counts

    monkeypatch.setattr(postprocess, "MASK_BYTES", 4 * 97 * 150 * 2)  # resized in chunks
    prompts = ["a", "b"]
    outputs = tuple(t.to(dtype) for t in random_outputs(len(sizes), len(prompts), seed=5))
    batch = postprocess.batch_instances(outputs, prompts, sizes, threshold)
    assert len(batch) == len(sizes) and (sum(map(len, batch)) > 0 or threshold > 0.9)
    for index, (hw, packed) in enumerate(zip(sizes, batch)):
        whole = instances(outputs, prompts, hw, index, threshold)
        assert len(whole) == len(packed)
        for a, b in zip(whole, packed):
            assert (a.prompt, a.query, a.score, a.box_xyxy, a.area) == (b.prompt, b.query, b.score, b.box_xyxy, b.area)
            assert b.mask is None and a.area == int(a.mask.sum())
            expected = coco_mask.encode(np.asfortranarray(a.mask.astype(np.uint8)))["counts"].decode("ascii")
            assert coco_counts(b.bits, *hw) == expected


def test_bits_are_packed_as_numpy_packs_them_and_one_copy_brings_every_tensor_back():
    rows = torch.rand(3, 21, generator=torch.Generator().manual_seed(0)) > 0.5  # 21: the last byte padded
    assert np.array_equal(postprocess.pack_bits(rows).numpy(), np.packbits(rows.numpy(), axis=1))
    tensors = (torch.randn(2, 3), torch.arange(5), torch.zeros(0, dtype=torch.uint8), rows)
    for t, a in zip(tensors, postprocess.to_host(*tensors)):
        assert a.shape == tuple(t.shape) and np.array_equal(a, t.numpy())


def test_encoding_the_masks_keeps_rows_without_instances_and_takes_an_empty_batch():
    import pyarrow as pa

    from sam3_aoti.batch.schemas import found_schema, segmented_schema
    from sam3_aoti.batch.worker import encode_masks

    assert encode_masks(pa.Table.from_pylist([], schema=found_schema())).schema == segmented_schema()
    rows = [{"source": "broken.jpg", "width": 0, "height": 0, "error": "not an image", "seconds": 0.0, "instances": []},
            {"source": "empty.jpg", "width": 3, "height": 2, "error": "", "seconds": 0.1, "instances": []}]
    assert encode_masks(pa.Table.from_pylist(rows, schema=found_schema())).to_pylist() == rows
