"""SAM3's sections (ViT, text encoder, ... the sub-networks bench times) as the whole model calls them, for
timing each alone: one call of the export wrapper records every section's inputs (after the precision recipe cast
them), so a section re-run alone gets exactly what it gets inside the model at that shape."""

from __future__ import annotations

import torch

# The sections of one model call, in call order: name -> the Sam3Model children that are that section. The geometry
# encoder is the wrapper's own no-box path (`empty_geometry_prompt`), not a module call; the DETR encoder also holds
# its first self-attention and the mask decoder its laterals, which the wrapper runs per image before their calls.
SECTIONS = {
    "ViT": ("vision_encoder",),
    "text encoder": ("text_encoder", "text_projection"),
    "geometry encoder": (),
    "DETR encoder": ("detr_encoder",),
    "DETR decoder": ("detr_decoder",),
    "mask decoder": ("mask_decoder",),
    "scoring": ("dot_product_scoring",),
}
GEOMETRY = "geometry encoder"


class SectionCall:
    """One section's calls in one model call: `run()` repeats them on the recorded inputs."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls  # [(callable, args, kwargs)]

    def run(self):
        return [fn(*args, **kwargs) for fn, args, kwargs in self.calls]

    def compiled(self, compile_fn, done: dict) -> "SectionCall":
        """The same calls through `compile_fn` (e.g. torch.compile). `done` keeps each compiled callable by section
        and position, so the same section recorded at another shape reuses it (and its compiled code)."""
        calls = []
        for i, (fn, args, kwargs) in enumerate(self.calls):
            if (self.name, i) not in done:
                done[(self.name, i)] = compile_fn(fn)
            calls.append((done[(self.name, i)], args, kwargs))
        return SectionCall(self.name, calls)


def _per_image_methods(wrapper) -> dict[str, tuple]:
    """The methods the wrapper calls once per image outside a section's module call: section child -> (module, name).
    The DETR encoder's first self-attention; with `pixel_decoder_per_image`, the mask decoder's laterals."""
    model = wrapper.model
    methods = {"detr_encoder": (model.detr_encoder.layers[0], "self_attend")}
    if wrapper.per_image_laterals:
        methods["mask_decoder"] = (model.mask_decoder, "laterals")
    return methods


def record_section_calls(wrapper, images: torch.Tensor, token_ids: torch.Tensor) -> dict[str, SectionCall]:
    """Every section of `SECTIONS` with the calls one `wrapper(images, token_ids)` makes of it."""
    model, seen, vision = wrapper.model, {}, []
    children = [c for names in SECTIONS.values() for c in names]
    methods = _per_image_methods(wrapper)
    per_image = {child: [] for child in methods}

    def recording(child, method):
        def call(*args):
            per_image[child].append((method, args, {}))
            return method(*args)
        return call

    def remember(child):
        def hook(module, args, kwargs):
            seen.setdefault(child, []).append((module, args, dict(kwargs)))
        return hook

    hooks = [model.get_submodule(c).register_forward_pre_hook(remember(c), with_kwargs=True) for c in children]
    hooks.append(model.vision_encoder.register_forward_hook(lambda module, args, out: vision.append(out)))
    for child, (module, name) in methods.items():
        setattr(module, name, recording(child, getattr(module, name)))
    try:
        with torch.no_grad():
            wrapper(images, token_ids)
    finally:
        for hook in hooks:
            hook.remove()
        for module, name in methods.values():
            delattr(module, name)
    missing = [c for c in children if c not in seen] + [f"{m[1]} once" for c, m in methods.items()
                                                         if len(per_image[c]) != 1]
    if missing or len(vision) != 1:
        raise RuntimeError(f"one model call did not call {missing or ['vision_encoder once']}: the sections moved in "
                           "transformers' Sam3Model; update model/section_calls.py")
    for child, calls in per_image.items():
        seen[child] = calls + seen[child]
    sections = {name: SectionCall(name, [call for c in names for call in seen[c]]) for name, names in SECTIONS.items()}
    sections[GEOMETRY] = SectionCall(GEOMETRY, [(wrapper.empty_geometry_prompt, (vision[0],), {})])
    return sections
