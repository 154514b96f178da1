"""The package's interface in its metadata: the models' inputs and outputs, boxes, masks, scores, the tokenizer.
The `package` stage writes it into `metadata.json`; the `fallback` stage puts the exported programs behind the
same interface to measure them before any package exists. Computed from the program digests alone
(`export/program.json`, and `export/parts.json` where the profile is split)."""

from __future__ import annotations

import json

from ..errors import PackageError
from ..runtime.archive import PART_NAMES, SHARED_WEIGHT_PARTS, VOCAB_FILE


def exported_signatures(paths, split: bool) -> dict:
    """Every exported program's inputs and outputs (`programs`), and each archive's digest (`sha256`: `program`,
    and `parts_program` where `split`), from the digests the export stages wrote."""
    digests = {"program": paths.program_digest, **({"parts_program": paths.parts_digest} if split else {})}
    signatures = {"sha256": {}, "programs": {}}
    for name, path in digests.items():
        digest = json.loads(path.read_text())
        signatures["sha256"][name] = digest["sha256"]
        signatures["programs"].update(digest["programs"])
    return signatures


def interface_metadata(settings, program: dict, parts: list[str]) -> dict:
    """What a consumer calls and gets: `parts` are the split models the package holds (`PART_NAMES`' order)."""
    from ..runtime import contract
    from ..runtime.tokenizer import CONTEXT_LENGTH, END, PAD, SPECIAL_TOKENS, START

    model_io, transforms_io = program["programs"]["model"], program["programs"]["transforms"]
    images, _ = model_io["example_inputs"]
    side = images["shape"][2:]
    return {
        "format": contract.METADATA_FORMAT,
        "profile": settings.profile,
        "device": settings.device,
        "models": {
            "model": {
                "inputs": {
                    "images": {"shape": ["batch", 3, *side], "dtype": "float32"},
                    "token_ids": {"shape": ["num_prompts", CONTEXT_LENGTH], "dtype": "int64"},
                },
                "outputs": {name: {"shape": ["batch*num_prompts", *o["shape"][1:]], "dtype": o["dtype"]}
                            for name, o in zip(contract.OUTPUT_NAMES, model_io["outputs"])},
                "output_order": list(contract.OUTPUT_NAMES),  # the runner returns a tuple; json sorts the dict above
                "dynamic_dims": {"batch": {"min": 1}, "num_prompts": {"min": 1}},
                "pairing": contract.PAIRING,
            },
            "transforms": {
                "inputs": {"images": {"shape": ["batch", 3, "height", "width"], "dtype": "float32",
                                      "range": list(contract.IMAGE_RANGE)}},
                "outputs": {"images": {"shape": ["batch", 3, *side], "dtype": transforms_io["outputs"][0]["dtype"]}},
                "dynamic_dims": {"batch": {"min": 1}, "height": {"min": 2}, "width": {"min": 2}},
                "normalize": {"mean": contract.IMAGE_MEAN, "std": contract.IMAGE_STD, "after_scale": 1 / 255},
                "resize": contract.RESIZE,
            },
            **{name: part_metadata(program, name) for name in PART_NAMES if name in parts},
        },
        "box_format": contract.BOX_FORMAT,
        "exemplars": {"model": "encode_boxes", "box_format": contract.BOX_FORMAT, "max_boxes": contract.MAX_BOXES,
                      "labels": {"positive": contract.POSITIVE, "negative": contract.NEGATIVE,
                                 "padding": contract.PADDING},
                      "prompt_without_phrase": contract.VISUAL_PROMPT} if "encode_boxes" in parts else None,
        "mask_format": contract.MASK_FORMAT,
        "score": contract.SCORE,
        "tokenizer": {"start": START, "end": END, "pad": PAD, "context_length": CONTEXT_LENGTH,
                      "vocab_file": VOCAB_FILE, "attention_mask": "token_ids != 0",
                      "special_tokens": list(SPECIAL_TOKENS),
                      "clean": "ftfy.fix_text, html.unescape twice, whitespace runs to one space, strip, lower case",
                      "reference": "Meta's sam3/model/tokenizer_ve.py SimpleTokenizer (open_clip's)"},
    }


def part_metadata(program: dict, name: str) -> dict:
    """A split model's inputs and outputs (`contract`'s names), dim 0 named: images are `batch`, prompts
    `num_prompts`, pairs both."""
    from ..runtime import contract

    image, text, pairs = ["batch"], ["num_prompts"], ["batch*num_prompts"]
    inputs, input_dims, outputs, output_dims = {
        "encode_image": (("images",), image, contract.IMAGE_FEATURES, image * len(contract.IMAGE_FEATURES)),
        "encode_text": (("token_ids",), text, contract.TEXT_FEATURES, text * len(contract.TEXT_FEATURES)),
        "encode_boxes": (contract.BOX_INPUTS, image * len(contract.BOX_INPUTS), contract.GEOMETRY,
                         image * len(contract.GEOMETRY)),
        "decode": (contract.DECODE_INPUTS, image * 6 + text * 2, contract.OUTPUT_NAMES,
                   pairs * len(contract.OUTPUT_NAMES)),
    }[name]
    # the second dim, where it is dynamic: the boxes per image, and the geometry prompt's tokens (boxes + 1)
    second = {"encode_boxes": {"boxes": "boxes", "box_labels": "boxes", "geometry_prompt": "boxes+1",
                               "geometry_mask": "boxes+1"},
              "decode": {"geometry_prompt": "geometry_tokens", "geometry_mask": "geometry_tokens"}}.get(name, {})
    io = program["programs"][name]

    def described(labels, firsts, tensors):
        if len(tensors) != len(labels):
            raise PackageError(f"the exported {name} has {len(tensors)} tensors where {len(labels)} were expected: "
                               "run `uv run doit export` again")
        return {n: {"shape": [d, *([second[n]] if n in second else t["shape"][1:2]), *t["shape"][2:]],
                    "dtype": t["dtype"]} for n, d, t in zip(labels, firsts, tensors)}

    return {"inputs": described(inputs, input_dims, io["example_inputs"]), "input_order": list(inputs),
            "outputs": described(outputs, output_dims, io["outputs"]), "output_order": list(outputs),
            **({"weights_from": "model"} if name in SHARED_WEIGHT_PARTS else {})}  # shared: the loader hands it model's tensors
