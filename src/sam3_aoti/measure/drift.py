"""A package against eager, measured: what `verify` gates (`pipeline.gates`), and what the `fallback_drift`
stage measures of the exported fallback beside the compile (so verify, after the package, reads those numbers
instead of loading the fallback).

`measure_drift` runs every way each backend runs on every input verify compares (`model.reference`) and keeps
plain numbers (JSON), so a tolerance changed since the measurement still gates it.
"""

from __future__ import annotations


def expected_shapes(config, n: int) -> list[list[int]]:
    queries = config.detr_decoder_config.num_queries
    side = 4 * config.vision_config.backbone_config.image_size // config.vision_config.backbone_config.patch_size
    return [[n, queries, 1], [n, queries, 4], [n, queries, side, side], [n, 1]]


def ways_to_run(package) -> dict:
    """`model`, and for a split package its parts: whole, and with the prompts encoded and decoded in chunks
    of two, and the whole compiled model where `model` is the parts' one call (`runtime.split_call`), or that call
    on a GPU where it is not (on the CPU it is " split"); each must give model's outputs."""
    if not package.parts:
        return {"": package.model}

    def chunked(images, token_ids):
        texts = [package.encode_text(token_ids[i:i + 2]) for i in range(0, token_ids.shape[0], 2)]
        return package.decode_chunked(package.encode_image(images), texts)

    other = ({" whole": package["model"]} if package.split_call else
             {" split call": package["model_from_parts"]} if package.metadata.get("device") == "cuda" else {})
    return {"": package.model, " split": lambda images, token_ids: package.decode(
        package.encode_image(images), package.encode_text(token_ids)), " chunks": chunked, **other}


def measure_drift(settings, backends: dict, eager, transforms, cases, cache) -> list[dict]:
    """Each backend (name -> a package, or exported programs behind its interface), each way it runs, on every
    input verify compares, against eager (`eager()`: the model, loaded only for an input the `reference` stage
    did not compute). One record per measurement: output shapes, a case's transforms, or a run's metrics."""
    import torch

    from ..model.checkpoints import checkpoint_config
    from ..model.reference import compared_inputs, eager_outputs
    from ..pipeline.metrics import compare

    band = settings.stage("verify")["tolerances"][settings.spec.tolerances].get("mask_band", 0.0)
    config = checkpoint_config(settings)
    ways = {backend: ways_to_run(pkg) for backend, pkg in backends.items()}
    records: list[dict] = []
    encode_prompts = next(iter(backends.values())).encode_prompts
    with torch.no_grad():
        for item in compared_inputs(settings, config, cases, encode_prompts, transforms, torch.device(settings.device)):
            reference = eager_outputs(cache, item, eager)
            if item.image is None:  # a sweep shape: every way of every backend, shapes first
                want = expected_shapes(config, item.inputs[0].shape[0] * item.inputs[1].shape[0])
                for backend, by_way in ways.items():
                    for how, run in by_way.items():
                        out = run(*item.inputs)
                        got = [list(o.shape) for o in out]
                        records.append({"backend": backend + how, "case": item.label, "shapes": got, "want": want})
                        if got == want:
                            records.append({"backend": backend + how, "case": item.label,
                                            "metrics": compare(out, reference, mask_band=band)})
                continue
            ref_images, token_ids, *boxes = item.inputs
            for backend, pkg in backends.items():
                images = pkg.transforms(item.image)
                records.append({"backend": backend, "case": item.label,
                                "transforms_max_abs": float((images - ref_images).abs().max())})
                runs = ({" boxes": lambda i, t, p=pkg: p.model_with_boxes(i, t, *boxes)} if item.with_boxes
                        else ways[backend])  # exemplars: through the parts (encode_image, encode_boxes, decode)
                for how, run in runs.items():
                    records.append({"backend": backend + how, "case": item.label,
                                    "metrics": compare(run(images, token_ids), reference, mask_band=band)})
    return records


def fallback_key(settings, fallback_sha256: str, cache) -> str:
    """What the fallback_drift stage's numbers hold for: the fallback's bytes, verify's inputs (its shapes, the cases
    file), the mask band its IoU leaves out, and eager's identity (weights, model code, versions)."""
    import hashlib
    import json

    from ..pipeline.paths import DEFAULT_CASES
    from ..pipeline.settings import compared_shapes

    tol = settings.stage("verify")["tolerances"][settings.spec.tolerances]
    body = {"fallback": fallback_sha256, "inputs": compared_shapes(settings), "mask_band": tol.get("mask_band", 0.0),
            "cases": hashlib.sha256(DEFAULT_CASES.read_bytes()).hexdigest(), "eager": cache.identity}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
