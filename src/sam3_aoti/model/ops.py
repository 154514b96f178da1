"""The project's ops as the model calls them: the op itself (`torch.ops.sam3_aoti.*`), which AOTInductor compiles
with its kernel, or, inside `torch_forms()`, the torch ops it computes (its module's `reference`).

The fallback stage exports the model inside `torch_forms()`: programs that deserialize where torch alone is
installed, in the time of an export. Writing the ops out of the exported programs afterwards
(`ExportedProgram.run_decompositions`) re-traced every program: 22 s on the tiny model where its export takes 15,
and 170 s at full size.
"""

from __future__ import annotations

import contextlib

import torch

from ..runtime import attention as _attention, box_bias as _box_bias, fp8_linear as _fp8_linear  # register the ops

# A module flag, not a ContextVar: torch.compile (bench's parts, the torch.compile column) traces a global read and
# guards on it, but stops at ContextVar.get. The fallback stage exports in one thread.
_torch_forms = False


@contextlib.contextmanager
def torch_forms():
    """Inside: every op of this module is the torch ops it computes, not a call of the op."""
    global _torch_forms
    before, _torch_forms = _torch_forms, True
    try:
        yield
    finally:
        _torch_forms = before


def attention(query, key, value, scale: float, bias_y=None, bias_x=None):
    if _torch_forms:
        return _attention.reference(query, key, value, scale, bias_y, bias_x)
    return torch.ops.sam3_aoti.attention(query, key, value, scale, bias_y, bias_x)


def box_bias_mlp(deltas, w1, b1, w2, b2):
    if _torch_forms:
        return _box_bias.linear_layers(deltas, w1, b1, w2, b2).contiguous()
    return torch.ops.sam3_aoti.box_bias_mlp(deltas, w1, b1, w2, b2)


def fp8_linear_gelu(rows, row_scales, weight, weight_scales, bias):
    if _torch_forms:
        return _fp8_linear.reference(rows, row_scales, weight, weight_scales, bias)
    return torch.ops.sam3_aoti.fp8_linear_gelu(rows, row_scales, weight, weight_scales, bias)


def fp8_linear_rope(rows, row_scales, weight, weight_scales, bias, cos, sin, rotated: int):
    if _torch_forms:
        return _fp8_linear.rope_reference(rows, row_scales, weight, weight_scales, bias, cos, sin, rotated)
    return torch.ops.sam3_aoti.fp8_linear_rope(rows, row_scales, weight, weight_scales, bias, cos, sin, rotated)
