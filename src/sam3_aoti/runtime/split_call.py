"""`model(images, token_ids)` of a split package as one call of its parts, the prompts' encoder beside the image
encoder on a CUDA stream of its own.

A compiled model runs its kernels one after another on one stream, so the text encoder (about 1 ms at one
prompt on the H200: small GEMMs that leave most of the card idle) waits for the image encoder or holds it up.
The parts are compiled apart (encode_image, encode_text, encode_boxes, decode), and only decode needs both
encoders' outputs: here encode_text runs on a side stream forked from the caller's and joined back before
decode, so on a GPU the two encoders overlap, inside one CUDA graph when the package replays graphs (the
capture follows the fork and the join). Exemplar boxes are encoded on the caller's stream after the image they
are drawn on. On the CPU the parts run in turn.

On by default for a CUDA package: on an H100 (benchmarks/h100-2026-12-07-split-call/) it was faster than the whole
compiled model at every shape the bench times, 0.3-2 ms a call. `load_package(split_call=False)` or
SAM3_AOTI_SPLIT_CALL=0 runs the whole model instead (`package["model"]` is always the whole model).
"""

from __future__ import annotations

import os
from typing import Callable

from .archive import PART_NAMES

SWITCH = "SAM3_AOTI_SPLIT_CALL"  # "0": split packages' model is the whole compiled model; "1": the SplitCall, CPU too


def split_call_wanted(requested: bool | None, device: str) -> bool:
    """`load_package(split_call=...)` if given, else the environment switch, else on for a CUDA package (where the
    encoders overlap); on the CPU the parts only run in turn, so there the whole compiled model."""
    if requested is not None:
        return requested
    switch = os.environ.get(SWITCH, "")
    return switch == "1" if switch in ("0", "1") else device == "cuda"


class SplitCall:
    """`call(images, token_ids)`, or `call(images, token_ids, boxes, labels)` with exemplar boxes on every image:
    decode's outputs, in `model`'s pairing. `runners`: the package's parts by name, called with flat tensors."""

    def __init__(self, runners: dict[str, Callable], device: str):
        import torch

        self.encode_image, self.encode_text, self.encode_boxes, self.decode = (runners[n] for n in PART_NAMES)
        self.side = torch.cuda.Stream() if device == "cuda" else None  # the text encoder's

    def __call__(self, images, token_ids, *boxes_and_labels):
        import torch

        if self.side is None:
            return self._decode(self.encode_image(images), self.encode_text(token_ids), boxes_and_labels)
        caller = torch.cuda.current_stream()
        self.side.wait_stream(caller)  # token_ids are written on the caller's stream
        with torch.cuda.stream(self.side):
            text = self.encode_text(token_ids)
        features = self.encode_image(images)
        caller.wait_stream(self.side)
        for t in text:
            t.record_stream(caller)  # made on the side stream, read and freed on the caller's
        return self._decode(features, text, boxes_and_labels)

    def _decode(self, features, text, boxes_and_labels):
        if boxes_and_labels:  # encode_boxes reads fpn_level2 and the position encoding (contract.IMAGE_FEATURES)
            geometry = self.encode_boxes(features[6], features[3], *boxes_and_labels)
        else:
            geometry = features[4:6]
        return self.decode(*features[:4], *geometry, *text)
