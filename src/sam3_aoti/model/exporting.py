"""torch.export of the grounding wrapper (dynamic batch and prompt counts), of its parts for encode once /
decode many, and of the image transforms (any batch, height and width)."""

from __future__ import annotations

from ..errors import ExportError, first_line


def export_model(wrapper, example_args, batch_name="batch", prompts_name="num_prompts"):
    import torch
    from torch.export import Dim

    dynamic = {"images": {0: Dim(batch_name, min=1)}, "token_ids": {0: Dim(prompts_name, min=1)}}
    with torch.no_grad():
        return torch.export.export(wrapper, example_args, dynamic_shapes=dynamic)


def export_transforms(module, example_image):
    import torch
    from torch.export import Dim

    dynamic = {"images": {0: Dim("batch", min=1), 2: Dim("height", min=2), 3: Dim("width", min=2)}}
    with torch.no_grad():
        return torch.export.export(module, (example_image,), dynamic_shapes=dynamic)


def export_parts(wrapper, example) -> dict:
    """`[export] split`: the image encoder, the text encoder and the heads (`decode`) as programs of their own,
    traced at the model's example, with the same dynamic batch and prompt counts."""
    import torch
    from torch.export import Dim

    from ..model.grounding import Part

    images, token_ids = example
    with torch.no_grad():  # contiguous, as the runners pass every input: AOTInductor compiles for the example's strides
        features, text = ([t.contiguous() for t in part(x)] for part, x in
                          ((wrapper.encode_image, images), (wrapper.encode_text, token_ids)))
    batch, prompts = Dim("batch", min=1), Dim("num_prompts", min=1)
    specs = {"encode_image": ((images,), ({0: batch},)),
             "encode_text": ((token_ids,), ({0: prompts},)),
             "decode": ((*features, *text), (*[{0: batch}] * len(features), *[{0: prompts}] * len(text)))}
    programs = {}
    for name, (args, dims) in specs.items():
        try:
            with torch.no_grad():
                programs[name] = torch.export.export(Part(wrapper, name), args, dynamic_shapes={"args": dims})
        except Exception as e:
            raise ExportError(f"torch.export of {name} failed: {first_line(e)}") from e
    return programs


def composed(programs: dict):
    """`decode(*encode_image(images), *encode_text(token_ids))` through the exported parts."""
    image, text, decode = (programs[name].module() for name in ("encode_image", "encode_text", "decode"))
    return lambda images, token_ids: decode(*image(images), *text(token_ids))
