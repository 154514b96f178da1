"""SAM3's visual prompts: exemplar boxes (positive, negative) beside a phrase or alone, encoded on one image and
used on others. The wrapper against transformers' own forward with `input_boxes`, the boxes' effect on the
outputs, the runtime's checks, and the package end to end (`predict --box`)."""

import copy
import json
import types

import pytest
import torch

from sam3_aoti.errors import InputError
from sam3_aoti.model.configs import example_inputs
from sam3_aoti.model.exporting import example_boxes
from sam3_aoti.model.grounding import Sam3Grounding
from sam3_aoti.model.roi_align import roi_align
from sam3_aoti.runtime.exemplars import normalized_boxes, parse_box

from helpers import predict

OUTPUTS = ("logits", "boxes", "masks", "presence")
BOXES = torch.tensor([[[0.3, 0.4, 0.2, 0.3], [0.7, 0.6, 0.3, 0.2], [0.5, 0.5, 0.1, 0.1]]])
LABELS = torch.tensor([[1, 0, -10]])


@pytest.fixture(scope="module")
def wrapper(tiny_model):
    return Sam3Grounding(copy.deepcopy(tiny_model), masked_attention="eager").eval()


def xyxy_to_cxcywh(boxes):
    x1, y1, x2, y2 = boxes.unbind(-1)
    return torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], -1)


def test_boxes_through_the_wrapper_are_transformers_forward_with_input_boxes(wrapper, tiny_model, monkeypatch):
    """encode_image, encode_boxes and decode give what `Sam3Model.forward(input_boxes=, input_boxes_labels=)`
    gives (its torchvision ROI align stood in for by ours, which tests/test_roi_align.py holds to torchvision's),
    padding included, with a phrase and with Meta's "visual" alone."""
    import transformers.models.sam3.modeling_sam3 as sam3

    def torchvision_roi_align(features, boxes, size):  # torchvision's signature: one tensor of boxes per image
        return roi_align(features, torch.stack(list(boxes)), size).flatten(0, 1)

    monkeypatch.setattr(sam3, "torchvision", types.SimpleNamespace(ops=types.SimpleNamespace(
        roi_align=torchvision_roi_align)), raising=False)
    from sam3_aoti.model.checkpoints import build_model
    from sam3_aoti.pipeline.settings import load_settings

    plain = build_model(load_settings(device="cpu")).eval()  # as transformers made it (tests wrap tiny_model in place)
    images, token_ids = example_inputs(tiny_model.config, 1, 2, seed=3)
    for ids in (token_ids[:1], token_ids[1:]):
        with torch.no_grad():
            ours = wrapper.with_boxes(images, ids, BOXES, LABELS)
            out = plain(pixel_values=images, input_ids=ids, attention_mask=(ids != 0).long(), input_boxes=BOXES,
                        input_boxes_labels=LABELS)
        theirs = (out.pred_logits[..., None], xyxy_to_cxcywh(out.pred_boxes), out.pred_masks, out.presence_logits)
        for name, got, want in zip(OUTPUTS, ours, theirs):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_outputs_move_when_a_box_is_added_moved_or_flipped(wrapper, tiny_model):
    """A pipeline that ignores its boxes fails this: each change to the boxes moves the scores."""
    images, token_ids = example_inputs(tiny_model.config, 1, 1, seed=4)
    one, one_label = BOXES[:, :1], LABELS[:, :1]
    variants = {"text alone": None, "a box": (one, one_label), "a box added": (BOXES[:, :2], LABELS[:, :2]),
                "the box moved": (one + torch.tensor([0.2, 0.1, 0.0, 0.0]), one_label),
                "its label flipped": (one, 1 - one_label)}
    logits = {}
    with torch.no_grad():
        for name, boxes in variants.items():
            logits[name] = (wrapper(images, token_ids) if boxes is None else
                            wrapper.with_boxes(images, token_ids, *boxes))[0]
    for name in list(variants)[1:]:
        for other in variants:
            if other != name:
                assert float((logits[name] - logits[other]).abs().max()) > 1e-3, (name, other)


def test_padding_is_the_boxes_alone_and_boxes_of_one_image_search_another(wrapper, tiny_model):
    """Two images with two and one boxes (the second padded) give each image's own result; the geometry prompt
    of image A decoded with image B is the plumbing of one exemplar set searching many tiles, and on A itself it is
    the ordinary path exactly."""
    images, token_ids = example_inputs(tiny_model.config, 2, 1, seed=5)
    boxes, labels = BOXES[:, :2].repeat(2, 1, 1), torch.tensor([[1, 0], [1, -10]])
    with torch.no_grad():
        both = wrapper.with_boxes(images, token_ids, boxes, labels)
        second = wrapper.with_boxes(images[1:], token_ids, boxes[1:, :1], labels[1:, :1])
        text = wrapper.encode_text(token_ids)
        features_a, features_b = wrapper.encode_image(images[:1]), wrapper.encode_image(images[1:])
        geometry_a = wrapper.encode_boxes(features_a[-1], features_a[3], boxes[:1], labels[:1])
        on_a = wrapper.decode(*features_a[:4], *geometry_a, *text)
        on_b = wrapper.decode(*features_b[:4], *geometry_a, *text)
        ordinary = wrapper.with_boxes(images[:1], token_ids, boxes[:1], labels[:1])
    for got, want in zip(both, second):
        torch.testing.assert_close(got[1:], want, atol=1e-5, rtol=1e-4)
    for got, want in zip(on_a, ordinary):
        assert torch.equal(got, want)
    assert float((on_b[0] - second[0]).abs().max()) > 1e-4  # A's boxes on B are not B's own


@pytest.mark.parametrize("text, message", [
    ("1,2,3", "is not X0,Y0,X1,Y1"),
    ("a,b,c,d", "is not X0,Y0,X1,Y1"),
])
def test_a_box_that_is_not_four_numbers_is_one_line(text, message):
    with pytest.raises(InputError, match=message):
        parse_box(text)


@pytest.mark.parametrize("box, message", [
    ((10, 10, 5, 20), "corners reversed"),
    ((10, 10, 10, 20), "no area"),
    ((-1, 0, 10, 10), "outside the 100 x 50 image"),
    ((0, 0, 101, 10), "outside the 100 x 50 image"),
])
def test_a_bad_box_is_one_line_naming_it(box, message):
    with pytest.raises(InputError, match=message) as found:
        normalized_boxes([box], [1], 100, 50)
    assert f"box {box[0]:g},{box[1]:g}" in str(found.value)


def test_pixel_corners_become_normalized_centers_and_sizes_and_the_limit_holds():
    boxes, labels = normalized_boxes([(0, 0, 50, 25), (50, 25, 100, 50)], [1, 0], 100, 50)
    torch.testing.assert_close(boxes, torch.tensor([[[0.25, 0.25, 0.5, 0.5], [0.75, 0.75, 0.5, 0.5]]]))
    assert labels.tolist() == [[1, 0]]
    with pytest.raises(InputError, match="at most 32"):
        normalized_boxes([(0, 0, 1, 1)] * 33, [1] * 33, 100, 50)


def test_the_example_boxes_pad_one_image_and_stay_inside():
    boxes, labels = example_boxes(2, 3)
    assert labels[0, -1] == -10 and set(labels.flatten().tolist()) <= {-10, 0, 1}
    cx, cy, w, h = boxes.unbind(-1)
    assert bool(((cx - w / 2 >= 0) & (cx + w / 2 <= 1) & (cy - h / 2 >= 0) & (cy + h / 2 <= 1)).all())


def test_the_package_takes_exemplars_from_python(package_path):
    """The tiny package: encode_boxes + decode equals model_with_boxes; exemplars of one image decode another
    batch (broadcast); boxes move the outputs; bad boxes and labels are one line."""
    from sam3_aoti.runtime.loader import load_package

    pkg = load_package(package_path)
    assert "encode_boxes" in pkg.parts and pkg.metadata["exemplars"]["max_boxes"] == 32
    images, ids = torch.rand(2, 3, 112, 112) * 2 - 1, pkg.encode_prompts(["a roof"])
    with torch.no_grad():
        features, text = pkg.encode_image(images), pkg.encode_text(ids)
        exemplars = pkg.encode_boxes(features, BOXES[:, :2].repeat(2, 1, 1), LABELS[:, :2].repeat(2, 1))
        whole = pkg.model_with_boxes(images, ids, BOXES[:, :2].repeat(2, 1, 1), LABELS[:, :2].repeat(2, 1))
        parts = pkg.decode(features, text, exemplars)
        first = tuple(t[:1] for t in exemplars)
        broadcast = pkg.decode(features, text, first)
        plain = pkg.model(images, ids)
    for a, b in zip(whole, parts):
        assert torch.equal(a, b)
    torch.testing.assert_close(broadcast[0][:1], parts[0][:1])
    assert float((parts[0] - plain[0]).abs().max()) > 1e-3
    with pytest.raises(InputError, match="labels must be 1"):
        pkg.encode_boxes(features, BOXES[:, :1].repeat(2, 1, 1), torch.full((2, 1), 7))
    with pytest.raises(InputError, match="inside the image"):
        pkg.encode_boxes(features, torch.tensor([[[0.9, 0.9, 0.5, 0.5]]]).repeat(2, 1, 1))
    with pytest.raises(InputError, match="exemplars are for 2 images, features for 1"):
        pkg.decode(tuple(f[:1] for f in features), text, exemplars)
    with pytest.raises(InputError, match=r"features must be what encode_image returned \(7 tensors: .*got 4 values"):
        pkg.encode_boxes(features[:4], BOXES[:, :1].repeat(2, 1, 1))


def test_predict_with_boxes_alone_beside_a_phrase_and_drawn_on_another_image(package_path, tmp_path):
    """`predict --box/--negative-box` with and without `--prompt`, and `--boxes-on` another image: the JSON says
    what was given, the outputs differ from the phrase alone; bad boxes are one line, exit 2, before loading."""
    from PIL import Image

    Image.new("RGB", (120, 90), (200, 80, 40)).save(tmp_path / "tile.png")
    Image.new("RGB", (60, 40), (20, 80, 140)).save(tmp_path / "other.png")
    args = (str(package_path), "--image", "tile.png", "--threshold", "0")
    runs = {"phrase": ["--prompt", "a roof"],
            "boxes": ["--box", "10,10,50,40", "--negative-box", "60,50,100,80"],
            "both": ["--prompt", "a roof", "--box", "10,10,50,40"],
            "elsewhere": ["--prompt", "a roof", "--box", "5,5,30,30", "--boxes-on", "other.png"]}
    results = {}
    for name, extra in runs.items():
        proc = predict(*args, *extra, "--output", name, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
        assert (tmp_path / f"{name}.png").is_file()
    assert results["boxes"]["prompts"] == ["visual"]
    assert results["boxes"]["exemplars"]["boxes"][1] == {"box_xyxy": [60.0, 50.0, 100.0, 80.0], "label": "negative"}
    assert results["elsewhere"]["exemplars"]["image"].endswith("other.png")
    top = {name: r["instances"][0]["score"] for name, r in results.items()}
    assert len(set(top.values())) == len(top), top
    for bad, message in [("0,0,500,40", "outside the 120 x 90 image"), ("50,40,10,10", "reversed"),
                         ("1,2,3", "is not X0,Y0,X1,Y1")]:
        proc = predict(*args, "--box", bad, cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
