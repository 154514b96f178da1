"""ROI align in plain torch ops (model/roi_align.py) is torchvision's, which transformers' geometry encoder calls:
checked in meta_sam3's environment, which has torchvision (the project's has not)."""

import json
import os
import subprocess

import pytest
import torch

from sam3_aoti.model.roi_align import roi_align

from helpers import REPO
from test_meta_parity import META_PROJECT, uv


@pytest.mark.slow  # meta_sam3's environment: a process of its own
def test_roi_align_is_torchvisions_on_random_maps_and_edge_tiny_and_whole_map_boxes():
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    proc = subprocess.run([uv(), "run", "--project", str(META_PROJECT), "--locked", "--quiet", "python",
                           str(META_PROJECT / "roi_align_check.py"), str(REPO / "src")],
                          capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(cases) == 4
    for case in cases:
        assert case["max_abs"] <= 1e-6 * max(case["ref_max_abs"], 1.0), case


def test_roi_align_exports_with_dynamic_boxes_and_averages_inside_the_box():
    """The pooling exports with the box count dynamic, and a map that is constant inside a box pools to that
    constant there (each bin's samples averaged, none from outside the box)."""
    class Pool(torch.nn.Module):
        def forward(self, features, boxes):
            return roi_align(features, boxes, 7)

    features = torch.zeros(1, 2, 16, 16)
    features[:, :, 4:12, 2:10] = 3.0
    boxes = torch.tensor([[[3.0, 5.0, 9.0, 11.0], [2.5, 4.5, 9.5, 11.5]]])
    program = torch.export.export(Pool(), (features, boxes),
                                  dynamic_shapes={"features": None, "boxes": {1: torch.export.Dim("boxes", min=1)}})
    one = program.module()(features, boxes[:, :1])
    assert one.shape == (1, 1, 2, 7, 7)
    torch.testing.assert_close(one, torch.full_like(one, 3.0))
    torch.testing.assert_close(program.module()(features, boxes), Pool()(features, boxes))
