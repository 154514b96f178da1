"""The parity stage's CPU-checkable parts: the Meta-format round trip and the gates (the run itself is a GPU test)."""

import json

import pytest
import torch

from helpers import REPO
from sam3_aoti.pipeline.settings import load_settings
from sam3_aoti.errors import ConfigError
from sam3_aoti.pipeline.parity_checks import check
from sam3_aoti.stages.parity import parity_report, run
from sam3_aoti.model.meta import write_meta_checkpoint
from sam3_aoti.pipeline.report import markdown
from sam3_aoti.pipeline.paths import ProfilePaths

TOLERANCES = {"top1_same_min": 1.0, "score_abs": 1e-3, "box_abs": 1e-3, "top5_overlap_min": 0.8,
              "mask_iou_min": 0.98, "pixels_max_levels": 1}


def row(**changes):
    good = {"case": "astronaut", "prompts": ["a person"], "top1_same": 1.0, "score_abs": 1e-7,
            "matched_box_abs": 2e-7, "top5_overlap": 1.0, "topk_mask_iou_min": 1.0, "pred_logits": {"max_abs": 3e-7}}
    return {**good, **changes}


def test_gates_pass_at_fp32_noise_and_name_each_failure():
    assert all(c.ok for c in check([row()], TOLERANCES))
    checks = check([row(top1_same=2 / 3), row(case="coins", score_abs=0.01, topk_mask_iou_min=0.5),
                    row(case="camera", pixels_max_levels=3.0, pixels_differ=0.2)], TOLERANCES)
    assert [(c.case, c.metric) for c in checks if not c.ok] == [
        ("astronaut", "top-1 query same (share of pairs)"), ("coins", "score |diff| (every query)"),
        ("coins", "top-5 mask IoU (min)"), ("camera", "transforms vs Sam3Processor (levels)")]
    settings = load_settings(device="cpu")
    report = parity_report(settings, [row(pixels_max_levels=0.0, pixels_differ=0.0)], check([row()], TOLERANCES),
                           TOLERANCES, {"torch": "2.11"}, 1.0)
    text = markdown(report)
    assert "**PASSED: 5/5 checks**" in text and "| astronaut | a person | 100% |" in text and "random init" in text
    assert report.json()["passed"] and report.json()["cases"][0]["case"] == "astronaut"


@pytest.mark.parametrize("report, precision", [("h200-2026-12-01-speed/parity-fp32.json", "fp32"),
                                               ("h200-2026-12-01-speed/parity-bf16.json", "bf16"),
                                               ("h200-2026-12-01-parity/parity-parity.json", "bf16"),
                                               ("h200-2026-12-03-all-eight/parity-split.json", "bf16"),
                                               ("h100-2026-12-06-fp8-package/parity-fp8.json", "fp8")])
def test_the_committed_h200_parity_reports_pass_todays_gates(report, precision):
    """The limits in pipeline.toml hold for what the H200 measured (a tightened limit that the last run
    would fail shows here, not on the next GPU run). The bf16 runs: the DETR decoder's attentions in fp32
    (speed), then in bf16 (parity), then with all eight optimizations, the defaults then (all-eight); fp8: the
    fused fc1 recipe with thirteen optimizations (an H100)."""
    report = json.loads((REPO / "benchmarks" / report).read_text())
    checks = check(report["cases"], load_settings(device="cpu").stage("parity")["tolerances"][precision])
    assert len(checks) == 6 * len(report["cases"]) and all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert report["precision"] == precision and report["versions"]["gpu"].startswith(("NVIDIA H200", "NVIDIA H100"))


def test_every_precision_has_parity_tolerances_and_fp8_holds_the_issues_bars():
    """fp8 is compared with Meta's bf16 autocast at limits of its own: the same top-1 query for at least 98 % of
    pairs and matched masks at IoU 0.995 (issue #50), the rest at least as loose as bf16's."""
    tolerances = load_settings(device="cpu").stage("parity")["tolerances"]
    assert set(tolerances) == {"fp32", "bf16", "fp8"} and tolerances["fp32"]["top1_same_min"] == 1.0
    fp8, bf16 = tolerances["fp8"], tolerances["bf16"]
    assert fp8["top1_same_min"] == 0.98 and fp8["mask_iou_min"] == 0.995
    assert all(fp8[k] >= bf16[k] for k in ("score_abs", "box_abs", "mask_band", "pixels_max_levels"))


def test_meta_format_round_trip_of_a_built_checkpoint(built_repo):
    settings = load_settings(device="cpu", config=built_repo / "pipeline.toml", artifacts=built_repo / "artifacts")
    ours = write_meta_checkpoint(settings)  # raises if reading the Meta file back changes any tensor
    meta = torch.load(ProfilePaths.of(settings).meta_checkpoint, weights_only=True)["model"]
    assert all(k.startswith("detector.") for k in meta)
    assert sum(v.numel() for v in meta.values()) > sum(v.numel() for v in ours.values())  # + the cls position row


def test_parity_needs_the_full_model_on_a_gpu(built_repo):
    settings = load_settings(device="cpu", config=built_repo / "pipeline.toml", artifacts=built_repo / "artifacts")
    with pytest.raises(ConfigError, match="profile=sam3 device=cuda"):
        run(settings)
