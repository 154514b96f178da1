"""The parity stage's CPU-checkable parts: the Meta-format round trip and the gates (the run itself is a GPU test)."""

import pytest
import torch

from sam3_aoti.config import load_settings
from sam3_aoti.errors import ConfigError
from sam3_aoti.parity import check, markdown, run, write_meta_checkpoint
from sam3_aoti.paths import ProfilePaths

TOLERANCES = {"score_abs": 1e-3, "box_abs": 1e-3, "top5_overlap_min": 0.8, "mask_iou_min": 0.98, "pixels_max_levels": 1}


def row(**changes):
    good = {"case": "astronaut", "prompts": ["a person"], "top1_same": True, "score_abs": 1e-7,
            "matched_box_abs": 2e-7, "top5_overlap": 1.0, "topk_mask_iou_min": 1.0, "pred_logits": {"max_abs": 3e-7}}
    return {**good, **changes}


def test_gates_pass_at_fp32_noise_and_name_each_failure():
    assert check([row()], TOLERANCES) == []
    failures = check([row(top1_same=False), row(case="coins", score_abs=0.01, topk_mask_iou_min=0.5),
                      row(case="camera", pixels_max_levels=3.0, pixels_differ=0.2)], TOLERANCES)
    assert failures == ["astronaut: top-1 query differs", "coins: score_abs 0.01 (limit 0.001)",
                        "coins: topk_mask_iou_min 0.5 (limit 0.98)", "camera: transforms differ from Meta's by 3 levels"]
    report = {"tolerances": TOLERANCES, "cases": [row()], "failures": [], "passed": True, "weights": "random",
              "random_weights": True, "meta_sam3": "0.1.4"}
    assert "| astronaut | a person | ✓ |" in markdown(report) and "random init" in markdown(report)


def test_meta_format_round_trip_of_a_built_checkpoint(built_repo):
    settings = load_settings(device="cpu", config=built_repo / "pipeline.toml", artifacts=built_repo / "artifacts")
    ours = write_meta_checkpoint(settings)  # raises if reading the Meta file back changes any tensor
    meta = torch.load(ProfilePaths.of(settings).meta_checkpoint, weights_only=True)["model"]
    assert all(k.startswith("detector.") for k in meta)
    assert sum(v.numel() for v in meta.values()) > sum(v.numel() for v in ours.values())  # + the cls position row


def test_parity_needs_the_full_model_on_a_gpu(built_repo):
    settings = load_settings(device="cpu", config=built_repo / "pipeline.toml", artifacts=built_repo / "artifacts")
    with pytest.raises(ConfigError, match="profile=sam3 device=cuda precision=fp32"):
        run(settings)
