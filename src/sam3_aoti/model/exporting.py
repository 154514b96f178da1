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


def example_boxes(batch: int, count: int, seed: int = 0, device="cpu"):
    """Seeded exemplar boxes `[batch, count, 4]` (normalized cx, cy, w, h, inside the image) and labels
    (positive and negative; the last box of the first image padding when there are two or more)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    size = torch.rand(batch, count, 2, generator=g) * 0.5 + 0.05
    center = size / 2 + torch.rand(batch, count, 2, generator=g) * (1 - size)
    labels = torch.randint(0, 2, (batch, count), generator=g)
    if count > 1:
        labels[0, -1] = -10
    return torch.cat([center, size], -1).to(device), labels.to(device)


def export_parts(wrapper, example) -> dict:
    """`[export] split`: the image encoder, the text encoder, the exemplar encoder (`encode_boxes`) and the heads
    (`decode`) as programs of their own, traced at the model's example (the heads with exemplar boxes, so the
    geometry prompt's length is a dynamic dim), with dynamic batch, prompt and box counts."""
    import torch
    from torch.export import Dim

    from ..model.grounding import DECODE_IMAGE_INPUTS, Part
    from ..runtime.contract import MAX_BOXES

    images, token_ids = example
    boxes, labels = example_boxes(images.shape[0], 3, device=images.device)
    with torch.no_grad():  # contiguous, as the runners pass every input: AOTInductor compiles for the example's strides
        features, text = ([t.contiguous() for t in part(x)] for part, x in
                          ((wrapper.encode_image, images), (wrapper.encode_text, token_ids)))
        level2, position = features[-1], features[3]
        geometry = [t.contiguous() for t in wrapper.encode_boxes(level2, position, boxes, labels)]
    batch, prompts = Dim("batch", min=1), Dim("num_prompts", min=1)
    count, tokens = Dim("boxes", min=1, max=MAX_BOXES), Dim("geometry_tokens", min=1, max=MAX_BOXES + 1)
    image_inputs = features[:DECODE_IMAGE_INPUTS - 2]
    specs = {"encode_image": ((images,), ({0: batch},)),
             "encode_text": ((token_ids,), ({0: prompts},)),
             "encode_boxes": ((level2, position, boxes, labels), ({0: batch}, {0: batch}, {0: batch, 1: count},
                                                                   {0: batch, 1: count})),
             "decode": ((*image_inputs, *geometry, *text), (*[{0: batch}] * len(image_inputs),
                                                            *[{0: batch, 1: tokens}] * 2,
                                                            *[{0: prompts}] * len(text)))}
    programs = {}
    for name, (args, dims) in specs.items():
        try:
            with torch.no_grad():
                programs[name] = torch.export.export(Part(wrapper, name), args, dynamic_shapes={"args": dims})
        except Exception as e:
            raise ExportError(f"torch.export of {name} failed: {first_line(e)}") from e
    return programs


def custom_ops_in(program) -> set[str]:
    """The project's own ops (`sam3_aoti::...`) a program calls: what a loader without this project lacks."""
    return {str(node.target) for node in program.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("sam3_aoti.")}


def portable(programs: dict) -> dict:
    """The programs with `sam3_aoti::attention` and `sam3_aoti::box_bias_mlp` written out as the torch ops they
    compute (their reference forms, what they run off CUDA): the fallback then deserializes where only torch is
    installed (the kernels are the AOTI models' business). Programs without them stay as they are."""
    import torch

    from ..runtime import attention, box_bias

    table = {torch.ops.sam3_aoti.attention.default: attention.reference,
             torch.ops.sam3_aoti.box_bias_mlp.default:
                 lambda deltas, w1, b1, w2, b2: box_bias.linear_layers(deltas, w1, b1, w2, b2).contiguous()}
    out = {}
    for name, program in programs.items():
        out[name] = program.run_decompositions(table) if custom_ops_in(program) else program
        if left := custom_ops_in(out[name]):
            raise ExportError(f"{name} still calls {sorted(left)} after writing out the custom ops: add them to "
                              "model.exporting.portable")
    return out


def composed(programs: dict):
    """`decode(*encode_image(images), *encode_text(token_ids))` through the exported parts."""
    from ..model.grounding import DECODE_IMAGE_INPUTS

    image, text, decode = (programs[name].module() for name in ("encode_image", "encode_text", "decode"))
    return lambda images, token_ids: decode(*image(images)[:DECODE_IMAGE_INPUTS], *text(token_ids))


def composed_with_boxes(programs: dict):
    """`decode` of images, exemplar boxes and prompts through the exported parts (the grounding's own
    `with_boxes` is the eager side)."""
    from ..model.grounding import DECODE_IMAGE_INPUTS

    image, text, boxes, decode = (programs[name].module()
                                  for name in ("encode_image", "encode_text", "encode_boxes", "decode"))

    def run(images, token_ids, box_coordinates, labels):
        features = image(images)
        geometry = boxes(features[-1], features[3], box_coordinates, labels)
        return decode(*features[:DECODE_IMAGE_INPUTS - 2], *geometry, *text(token_ids))

    return run
