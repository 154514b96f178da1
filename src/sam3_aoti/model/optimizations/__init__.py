"""The speed optimizations `[export] optimizations` switches on, one module each (segment-anything-fast's one
trick per file, torchao's one registered transform per technique). Each computes what transformers does, faster,
by swapping its classes in on the model's instances; `optimize` applies those named, in the registry's order.

Adding one: a module here with its classes and an `apply(model)` under `@register(...)`, imported below in the
order it is applied, and its name in `pipeline.schema.OPTIMIZATIONS` (the list `doit` reads without torch; a
test holds the two equal). tests/test_optimizations.py then checks it alone and with all the others against
eager on the tiny model."""

from __future__ import annotations

from .registry import REGISTRY, Optimization, optimize, part_submodules, register

# The order they are applied in (the registry's), each after those its `after` names.
from . import box_bias_kernel, relu_epilogue, attention_kernel, vit_attention_kernel  # noqa: E402,F401  isort: skip
from . import vit_gelu_epilogue, vit_rope_tables, vit_patch_linear, vit_fused_qkv  # noqa: E402,F401  isort: skip
from . import vit_window_order, vit_qkv_rope  # noqa: E402,F401  isort: skip
from . import grid_bias_attention  # noqa: E402,F401  isort: skip
from . import decoder_shared_projections, pixel_decoder_per_image, text_fused_qkv  # noqa: E402,F401  isort: skip
from . import group_norm_by_channel  # noqa: E402,F401  isort: skip

__all__ = ["REGISTRY", "Optimization", "optimize", "part_submodules", "register"]
