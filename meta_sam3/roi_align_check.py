"""Our ROI align (src/sam3_aoti/model/roi_align.py) against torchvision's, as transformers calls it, in this
environment (it has torchvision; the project's has not). Usage: python roi_align_check.py SRC_FOLDER
Prints one JSON line: each case's max |ours - torchvision| and the largest |torchvision| value."""

import json
import sys

import torch
import torchvision

sys.path.insert(0, sys.argv[1])
from sam3_aoti.model.roi_align import roi_align  # noqa: E402

torch.manual_seed(0)
cases = []
for batch, channels, height, width, count in [(2, 8, 72, 72, 6), (1, 4, 8, 8, 7), (3, 16, 9, 13, 4), (1, 3, 7, 7, 3)]:
    features = torch.randn(batch, channels, height, width)
    size = torch.tensor([width, height], dtype=torch.float32)
    corner = torch.rand(batch, count, 2) * size
    boxes = torch.cat([corner, corner + torch.rand(batch, count, 2) * (size - corner)], -1)
    boxes[:, 0] = torch.tensor([0.0, 0.0, width, height])  # the whole map
    boxes[:, 1] = torch.tensor([width - 0.3, height - 0.2, width, height])  # tiny, at the far edge
    boxes[:, 2] = torch.tensor([0.0, 0.0, 0.01, 0.02])  # tiny, at the origin
    ours = roi_align(features, boxes, 7).flatten(0, 1)
    theirs = torchvision.ops.roi_align(features, list(boxes), 7, spatial_scale=1.0, sampling_ratio=-1, aligned=False)
    cases.append({"shape": [batch, channels, height, width, count], "max_abs": float((ours - theirs).abs().max()),
                  "ref_max_abs": float(theirs.abs().max())})
print(json.dumps(cases))
