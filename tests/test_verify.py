"""Verify's gates have teeth: a perturbed package is rejected; cases come from files and folders."""

import dataclasses
import tomllib

import pytest
import torch

from sam3_aoti.model.reference import ReferenceCache, sweep_shapes
from sam3_aoti.pipeline import gates
from sam3_aoti.pipeline import report
from sam3_aoti.stages import verify
from sam3_aoti.pipeline.cases import load_cases
from sam3_aoti.pipeline.settings import load_settings
from sam3_aoti.errors import ConfigError
from sam3_aoti.pipeline.metrics import compare, mask_iou
from sam3_aoti.model.grounding import ImageTransforms, Sam3Grounding
from sam3_aoti.runtime.loader import load_package

from helpers import REPO, TINY


class Perturbed:
    """A package whose model drifts: boxes shift by 0.01 and mask logits flip sign on one query."""

    def __init__(self, package):
        self.inner, self.parts = package, ()  # the whole model only
        self.transforms, self.encode_prompts = package.transforms, package.encode_prompts

    def model(self, images, token_ids):
        logits, boxes, masks, presence = self.inner.model(images, token_ids)
        masks = masks.clone()
        masks[:, 0] = -masks[:, 0]
        return logits, boxes + 0.01, masks, presence


def test_a_perturbed_package_fails_the_gates(built_repo, tmp_path):
    settings = load_settings(device="cpu", config=built_repo / "pipeline.toml", artifacts=built_repo / "artifacts")
    package = load_package(built_repo / TINY / "package" / "sam3.pt2")
    from transformers import Sam3Model

    model = Sam3Model.from_pretrained(built_repo / TINY / "weights" / "checkpoint").eval()
    eager = Sam3Grounding(model).eval()
    transforms = ImageTransforms(model.config.vision_config.backbone_config.image_size)
    cases = load_cases()[:2]
    cache = ReferenceCache(tmp_path / "reference", {"test": 1})
    calls = []  # each time verify asks for the eager model: once per input the cache lacks
    eager_model = lambda: calls.append(1) or eager  # noqa: E731
    honest = verify.run_checks(settings, {"aoti": package, "exported": package}, eager_model, transforms, cases, cache)
    assert all(r.ok for r in honest)
    compared = len(sweep_shapes(settings.stage("verify"))) + len(cases)
    assert cache.hits == 0 and len(calls) == compared
    rows = verify.run_checks(settings, {"aoti": Perturbed(package), "exported": package}, eager_model, transforms, cases,
                             cache)
    assert cache.hits == compared and len(calls) == compared  # eager ran once per input, never asked for again
    failed = {r.metric for r in rows if not r.ok and r.backend == "aoti"}
    assert {"pred_boxes max|diff|", "top-5 matched box max|diff|", "pred_masks max|diff|"} <= failed
    assert all(r.ok for r in rows if r.backend.startswith("exported"))
    assert {r.backend for r in honest} == {f"{b}{how}" for b in ("aoti", "exported") for how in ("", " split", " chunks")}


def test_verify_gates_the_fallback_stages_numbers_only_for_the_fallback_they_measured(built_repo, monkeypatch):
    """The fallback_drift stage's records stand in for loading the fallback where its key (the packaged
    fallback's sha256, checked against its digest, verify's inputs and eager's identity) is today's; any other
    key, and verify measures the fallback itself."""
    from sam3_aoti.pipeline.paths import ProfilePaths

    settings = load_settings(device="cpu", config=built_repo / "pipeline.toml", artifacts=built_repo / "artifacts")
    paths = ProfilePaths.of(settings)
    cache = ReferenceCache.of(settings)
    records = verify.fallback_measured(settings, paths, cache)
    assert records and {r["backend"] for r in records} == {"exported", "exported split", "exported chunks",
                                                          "exported boxes"}
    monkeypatch.setattr(verify, "fallback_key", lambda *args: "another fallback, inputs or eager")
    assert verify.fallback_measured(settings, paths, cache) is None


def test_mask_iou_and_matched_boxes():
    a = torch.zeros(1, 2, 4, 4)
    a[0, 0, :2] = 1
    b = a.clone()
    b[0, 0, :1] = -1  # half the mask gone
    assert mask_iou(a, b).tolist() == [[0.5, 1.0]]  # empty vs empty counts as agreement
    logits = torch.tensor([[[3.0], [1.0]]])
    boxes = torch.rand(1, 2, 4)
    presence = torch.zeros(1, 1)
    moved = boxes.clone()
    moved[0, 1] += 0.5  # the other query moves a lot; the top one only a little
    moved[0, 0] += 0.01
    metrics = compare((logits, moved, a, presence), (logits, boxes, a, presence), k=1)
    assert metrics["matched_box_abs"] == pytest.approx(0.01, abs=1e-6)
    assert metrics["pred_boxes"]["max_abs"] == pytest.approx(0.5, abs=1e-6)


def test_mask_iou_leaves_out_pixels_the_reference_has_not_decided():
    """Seen on the H200 with the random tiny model: |diff| 1.7e-6 flipped a pixel of a 97-pixel mask (IoU 0.99)."""
    reference = torch.full((1, 1, 10, 10), -1.0)
    reference[..., :1, :] = 1.0  # a 10-pixel mask
    reference[..., 5, 5] = -1e-7  # undecided: float noise may flip it
    noisy = reference.clone()
    noisy[..., 5, 5] = 1e-7
    assert mask_iou(noisy, reference).item() == pytest.approx(10 / 11)
    assert mask_iou(noisy, reference, band=1e-5).item() == 1.0
    drifted = noisy.clone()
    drifted[..., 0, :5] = -1.0  # half the decided mask lost: the band does not hide real drift
    assert mask_iou(drifted, reference, band=1e-5).item() == 0.5


def test_pearson_gates_only_the_dense_outputs():
    """Seen on the H200, bf16: presence r = -0.5 over 3 prompts while its |diff| was 2.4e-4."""
    tol = load_settings(device="cpu").stage("verify")["tolerances"]["bf16"]
    metrics = {name: {"max_abs": 1e-3, "pearson": 1.0} for name in ("pred_logits", "pred_boxes", "pred_masks")}
    metrics["presence_logit_dec"] = {"max_abs": 1e-4, "pearson": -0.5}
    metrics["pred_boxes"]["pearson"] = 0.987
    metrics.update(top1_score_abs=0.0, top5_overlap=1.0, matched_box_abs=0.0, topk_mask_iou_min=1.0)
    assert all(check.ok for check in gates.gate(metrics, tol, "aoti", "case"))
    metrics["pred_masks"]["pearson"] = 0.99  # dense masks decorrelating is drift
    failed = [check.metric for check in gates.gate(metrics, tol, "aoti", "case") if not check.ok]
    assert failed == ["pred_masks pearson r"]


def test_the_reference_cache_keys_by_identity_and_inputs_and_keeps_only_what_was_used(tmp_path):
    from sam3_aoti.model.reference import ReferenceCache

    calls = []
    twice = lambda x: calls.append(1) or (x * 2,)  # noqa: E731
    a, b = torch.ones(3), torch.zeros(3)
    first = ReferenceCache(tmp_path, {"weights": "w1"})
    first.get((a,), twice), first.get((b,), twice)
    again = ReferenceCache(tmp_path, {"weights": "w1"})
    assert torch.equal(again.get((a,), twice)[0], a * 2) and again.hits == 1 and len(calls) == 2
    assert again.prune() == 1 and len(list(tmp_path.glob("*.pt"))) == 1  # b's entry was not used: gone
    new_weights = ReferenceCache(tmp_path, {"weights": "w2"})
    new_weights.get((a,), twice)
    assert new_weights.hits == 0 and len(calls) == 3
    assert new_weights.prune() == 1 and len(list(tmp_path.glob("*.pt"))) == 1


def test_an_outputs_own_tolerance_overrides_the_shared_one():
    tol = {"max_abs": 1e-3, "max_rel": 0.06, "per_output": {"pred_boxes": {"max_abs": 1e-3, "max_rel": 0}}}
    assert gates.output_limit(tol, 0.5, "pred_masks") == pytest.approx(0.031)
    assert gates.output_limit(tol, 0.5, "pred_boxes") == pytest.approx(1e-3)
    assert gates.output_limit(tol, 0.5) == pytest.approx(0.031)


def test_a_failed_value_never_prints_as_its_limit():
    assert report.shown(0.9896907210350037, ">= 0.99", False) == "0.9897"  # the H200's tiny run read "0.99"
    assert report.shown(2.98e-07, "<= 0.001", True) == "2.98e-07"
    assert report.shown("match", "as expected", True) == "match"


def test_cases_from_a_folder_of_images(tmp_path):
    from PIL import Image

    (tmp_path / "tiles").mkdir()
    for name in ("b.png", "a.jpg"):
        Image.new("RGB", (40, 30), (10, 200, 30)).save(tmp_path / "tiles" / name)
    (tmp_path / "notes.txt").write_text("not an image")
    cases_file = tmp_path / "cases.toml"
    cases_file.write_text('[[case]]\nimage = "skimage:coffee"\nprompts = ["a cup"]\n\n'
                          '[[folder]]\npath = "tiles"\nprompts = ["a field", "a road"]\n')
    cases = load_cases(cases_file)
    assert [c.name for c in cases] == ["coffee", "a", "b"]
    assert cases[1].prompts == ("a field", "a road") and cases[1].load_image().shape == (30, 40, 3)
    cases_file.write_text('[[folder]]\npath = "missing"\nprompts = ["x"]\n')
    with pytest.raises(ConfigError, match="does not exist"):
        load_cases(cases_file)


def test_default_cases_are_real_photographs_with_prompts():
    cases = load_cases()
    assert len(cases) >= 6 and all(c.prompts for c in cases)
    for case in cases:
        image = case.load_image()
        assert image.ndim == 3 and image.shape[2] == 3 and min(image.shape[:2]) >= 256
        assert image.std() > 20  # a photograph, not a flat fill
    assert dataclasses.is_dataclass(cases[0])


def top_mask_flipped(outputs):
    logits, boxes, masks, presence = outputs
    masks = masks.clone()
    best = int(logits[0, :, 0].argmax())
    masks[0, best] = -masks[0, best]
    return logits, boxes, masks, presence


def prompt_major(outputs, b=2, p=3):
    """Pairs reordered (prompt, image) instead of (image, prompt): the pairing rule broken."""
    order = torch.tensor([i * p + j for j in range(p) for i in range(b)])
    return tuple(o[order] for o in outputs)


# What a broken build could do to the outputs, each of which the gates must catch.
PERTURBATIONS = {
    "presence negated": lambda o: (*o[:3], -o[3]),
    "presence zeroed": lambda o: (*o[:3], torch.zeros_like(o[3])),
    "presence +0.01": lambda o: (*o[:3], o[3] + 0.01),
    "boxes +0.005": lambda o: (o[0], o[1] + 0.005, *o[2:]),
    "one mask flipped": top_mask_flipped,
    "masks x 2": lambda o: (o[0], o[1], o[2] * 2, o[3]),
    "pairs in prompt-major order": prompt_major,
}


@pytest.fixture(scope="module")
def tiny_outputs(built_repo):
    from sam3_aoti.model.configs import example_inputs, tiny_config

    package = load_package(built_repo / TINY / "package" / "sam3.pt2")
    with torch.no_grad():
        return package.model(*example_inputs(tiny_config(), 2, 3, seed=7))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(PERTURBATIONS))
def test_each_perturbation_of_a_real_build_fails_verify(tiny_outputs, name, precision):
    tol = tomllib.loads((REPO / "pipeline.toml").read_text())["verify"]["tolerances"][precision]
    assert all(c.ok for c in gates.gate(compare(tiny_outputs, tiny_outputs), tol, "aoti", "clean"))
    perturbed = PERTURBATIONS[name](tiny_outputs)
    failed = [c.metric for c in gates.gate(compare(perturbed, tiny_outputs, mask_band=tol.get("mask_band", 0.0)),
                                            tol, "aoti", name) if not c.ok]
    assert failed, f"{name} passes every {precision} gate"


BOXES = torch.tensor([[[0.3, 0.4, 0.2, 0.3], [0.7, 0.6, 0.3, 0.2]]]).repeat(2, 1, 1)
LABELS = torch.tensor([[1, 0], [1, 1]])
BOX_PERTURBATIONS = {  # the package's inputs, changed as a pipeline that mishandles its boxes would change them
    "an exemplar box moved": lambda boxes, labels: (boxes + torch.tensor([0.05, 0.0, 0.0, 0.0]), labels),
    "a label flipped": lambda boxes, labels: (boxes, torch.where(labels == 0, 1, 0)),
    "the boxes ignored": lambda boxes, labels: None,
}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(BOX_PERTURBATIONS))
def test_each_box_perturbation_of_a_real_build_fails_verify(package_path, name, precision):
    """A package that ignores or misreads its exemplar boxes fails verify's gates against the right outputs."""
    from sam3_aoti.model.configs import example_inputs, tiny_config

    tol = tomllib.loads((REPO / "pipeline.toml").read_text())["verify"]["tolerances"][precision]
    package = load_package(package_path)
    images, token_ids = example_inputs(tiny_config(), 2, 3, seed=7)
    with torch.no_grad():
        right = package.model_with_boxes(images, token_ids, BOXES, LABELS)
        changed = BOX_PERTURBATIONS[name](BOXES, LABELS)
        wrong = package.model(images, token_ids) if changed is None else package.model_with_boxes(
            images, token_ids, *changed)
    failed = [c.metric for c in gates.gate(compare(wrong, right, mask_band=tol.get("mask_band", 0.0)), tol, "aoti",
                                            name) if not c.ok]
    assert failed, f"{name} passes every {precision} gate"


def test_eager_runs_in_real_fp32_for_an_fp32_build_and_its_cached_outputs_say_so(built_repo, monkeypatch):
    """PyTorch runs cuDNN convolutions in TF32 by default (about 1e-3 off fp32 on a GPU, 25 times verify's fp32
    limit): eager's outputs for an fp32 build (the reference stage's cache, render, verify's misses) are made
    with TF32 off, as verify and fallback_drift run the package and the fallback, and the reference cache's key
    says so, so entries made with TF32 on are not read."""
    from sam3_aoti.model.checkpoints import eager_reference

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    settings = load_settings(device="cpu", config=built_repo / "pipeline.toml", artifacts=built_repo / "artifacts")
    assert settings.precision == "fp32"
    eager_reference(settings)
    assert not torch.backends.cudnn.allow_tf32
    assert ReferenceCache.of(settings).identity["tf32_off"] is True


def test_the_tiny_model_reacts_to_image_and_prompt_far_beyond_its_limits(built_repo):
    """A gate is only as good as the signal under it: each output of the tiny CI model must move with the
    photograph and with the prompt by at least 100x the fp32 limit verify holds it to (pipeline.toml)."""
    from sam3_aoti.runtime.contract import OUTPUT_NAMES
    from sam3_aoti.model.checkpoints import eager_reference
    from sam3_aoti.runtime.postprocess import to_tensor

    settings = load_settings(device="cpu", config=built_repo / "pipeline.toml", artifacts=built_repo / "artifacts")
    tol = settings.stage("verify")["tolerances"]["fp32"]
    eager, transforms = eager_reference(settings)
    package = load_package(built_repo / TINY / "package" / "sam3.pt2")
    cases = [case for case in load_cases() if not case.boxes]  # distinct photographs, each with its own prompt
    prompts = package.encode_prompts([case.prompts[0] for case in cases])
    with torch.no_grad():
        outputs = [eager(transforms(to_tensor(case.load_image(), "cpu")), prompts) for case in cases]
    pairs = [(i, j) for i in range(len(cases)) for j in range(i + 1, len(cases))]
    for k, name in enumerate(OUTPUT_NAMES):
        grid = torch.stack([out[k] for out in outputs])  # [photograph, prompt, ...]
        limit = gates.output_limit(tol, float(grid.abs().max()))
        by_image = min(float((grid[i] - grid[j]).abs().max()) for i, j in pairs)  # another photograph, same prompts
        by_prompt = min(float((grid[:, i] - grid[:, j]).abs().max()) for i, j in pairs)  # another prompt
        assert min(by_image, by_prompt) >= 100 * limit, f"{name}: image {by_image:.3g}, prompt {by_prompt:.3g}, limit {limit}"
