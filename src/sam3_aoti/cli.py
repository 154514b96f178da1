"""`sam3-aoti predict PACKAGE --image FILE --prompt TEXT ... [--box X0,Y0,X1,Y1 ...]` runs a built package on one image;
`sam3-aoti info PACKAGE [--json]` says what a package holds; `sam3-aoti pull URL REF DEST` fetches a verified
package by a signed ref from a binary cache; `sam3-aoti cache keygen NAME --out KEYFILE` makes a signing key;
`sam3-aoti segment COLLECTION --package PACKAGE --prompt TEXT --output DIR` runs one over many images on Ray Data.

predict: tokenize (the archive's own vocabulary), `transforms`, `model` (a split package with more than 16 prompts:
the image encoded once, the prompts decoded 16 at a time), scores = sigmoid(logit) *
sigmoid(presence), threshold, masks resized to the image; writes an overlay PNG and a JSON of the instances.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from pathlib import Path

from .errors import PackageError, Sam3AotiError, first_line
from .runtime.contract import NEGATIVE, POSITIVE
from .runtime.exemplars import parse_box
from .runtime.images import read_image
from .runtime.inference import check_request, package_device


def check_output(output: Path) -> list[Path]:
    """PREFIX.png and PREFIX.json can be written: checked before the package loads and the model runs. Returns
    the folders it created, for a failed run to remove."""
    import os

    for target in outputs_of(output):
        if target.is_dir():
            raise PackageError(f"{target} is a folder: pass --output a path prefix such as out/roof")
    created = [p for p in [output.parent, *output.parent.parents] if not p.exists()]
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PackageError(f"cannot create {output.parent} ({first_line(e)}): pass another --output") from None
    if not os.access(output.parent, os.W_OK | os.X_OK):
        raise PackageError(f"{output.parent} is not writable: pass another --output")
    return created


def predict(package_path: Path, image_path: Path, prompts: list[str], threshold: float, output: Path,
            trust: bool = False, sha256: str | None = None, boxes: list = (), labels: list = (),
            exemplar_image: Path | None = None) -> dict:
    """`boxes` (pixel corners) with `labels` (1 positive, 0 negative) are exemplars drawn on `image_path`, or on
    `exemplar_image` when given (one exemplar set searched for in another image); with no prompt the phrase is
    Meta's "visual"."""
    check_request(prompts, boxes, threshold, exemplar_image)
    created = check_output(output)
    try:
        return _predict(package_path, image_path, prompts, threshold, output, trust, sha256, list(boxes),
                        list(labels), exemplar_image)
    except BaseException:
        for folder in created:  # the outermost last: only what this run made, and only if still empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def _predict(package_path: Path, image_path: Path, prompts: list[str], threshold: float, output: Path,
             trust: bool, sha256: str | None, boxes: list, labels: list, exemplar_image: Path | None) -> dict:
    import torch

    from .runtime.contract import VISUAL_PROMPT
    from .runtime.exemplars import normalized_boxes
    from .runtime.inference import encode_exemplars, run_prompts
    from .runtime.loader import load_package
    from .runtime.postprocess import instances, overlay, to_tensor

    image = read_image(image_path)
    drawn_on = read_image(exemplar_image) if exemplar_image else image
    exemplars = normalized_boxes(boxes, labels, drawn_on.shape[1], drawn_on.shape[0]) if boxes else None
    prompts = prompts or [VISUAL_PROMPT]
    # cuda_graphs off: one call, and a capture would only add warm-ups
    package = load_package(package_path, trust=trust, cuda_graphs=False, sha256=sha256)
    device = package_device(package.metadata)
    t0 = time.perf_counter()
    with torch.inference_mode():
        pixels = package.transforms(to_tensor(image, device))
        token_ids = package.encode_prompts(prompts).to(device)
        features = None
        if exemplars is not None:  # drawn on this image: its own features; on another: that image's
            features = package.encode_image(pixels)
            exemplars = encode_exemplars(package, exemplars, drawn_on, device,
                                         features if exemplar_image is None else None)
        outputs = run_prompts(package, pixels, token_ids, exemplars, features)
    seconds = time.perf_counter() - t0
    found = instances(outputs, prompts, image.shape[:2], threshold=threshold)
    given = [{"box_xyxy": list(b), "label": "positive" if label else "negative"} for b, label in zip(boxes, labels)]
    title = f"{image_path.name}: {', '.join(prompts)}" + (f", {len(boxes)} exemplar boxes" if boxes else "") \
        + (f" from {exemplar_image.name}" if exemplar_image else "") + f" (score >= {threshold})"
    result = {
        "image": str(image_path), "package": str(package_path), "width": image.shape[1], "height": image.shape[0],
        "prompts": prompts, "threshold": threshold, "backend": package.backends["model"],
        "seconds": round(seconds, 4), "instances": [inst.as_json() for inst in found],
    }
    if boxes:
        result["exemplars"] = {"image": str(exemplar_image or image_path), "boxes": given}
    picture, record = outputs_of(output)
    try:
        picture.parent.mkdir(parents=True, exist_ok=True)
        overlay(image, found, title, [] if exemplar_image else zip(boxes, labels)).save(picture)
        record.write_text(json.dumps(result, indent=2) + "\n")
    except OSError as e:
        raise PackageError(f"cannot write {picture} / {record} ({first_line(e)}): pass another --output") from None
    return result


def outputs_of(output: Path) -> tuple[Path, Path]:
    return output.parent / f"{output.name}.png", output.parent / f"{output.name}.json"


def show_info(path: Path, as_json: bool, trust: bool, sha256: str | None) -> None:
    from .runtime.info import archive_info, format_info

    info = archive_info(path, trust, sha256)
    print(json.dumps(info, indent=2) if as_json else format_info(info))


def keygen(name: str, out: Path) -> None:
    """A new ed25519 signing key in `out` (owner-only, never overwritten); its public key on stdout."""
    import os

    from .cache.signing import SecretKey

    key = SecretKey.generate(name)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise PackageError(f"{out} exists: a signing key is never overwritten; pass another --out") from None
    except OSError as e:
        raise PackageError(f"cannot write {out} ({first_line(e)}): pass another --out") from None
    with os.fdopen(fd, "w") as f:
        f.write(key.text() + "\n")
    print(key.public)
    print(f"sam3-aoti: secret key in {out}: push with SAM3_AOTI_SIGNING_KEY={out}; trust the line above on "
          "every machine that substitutes ([cache] trusted_keys or SAM3_AOTI_TRUSTED_KEYS)", file=sys.stderr)


def pull(url: str, ref: str, dest: Path, trusted: list[str], allow_older: bool = False) -> None:
    from .cache.binary_cache import pull as pull_ref
    from .cache.signing import trusted_keys

    t0 = time.perf_counter()
    origin = pull_ref(url, ref, dest, trusted_keys(trusted),
                      progress=lambda line: print(f"sam3-aoti pull: {line}", file=sys.stderr, flush=True),
                      allow_older=allow_older)
    print(f"{dest / 'sam3.pt2'}: ref {ref} from {url}, signed by {origin['signed_by']}, verified "
          f"({time.perf_counter() - t0:.1f} s)")


def run_segment(args) -> None:
    from .batch import segment

    boxes = [parse_box(b) for b in args.box] + [parse_box(b) for b in args.negative_box]
    labels = [POSITIVE] * len(args.box) + [NEGATIVE] * len(args.negative_box)
    stdout = sys.stdout
    sys.stdout = sys.stderr  # Ray prints the cluster's messages ("(raylet) ...") to stdout: it is the summary's alone
    summary = segment(args.collection, args.output, args.prompt, args.package and str(args.package), ref=args.ref,
                      cache=args.cache, trusted=args.trusted_key, threshold=args.threshold, boxes=boxes,
                      labels=labels, boxes_on=args.boxes_on, batch_size=args.batch_size,
                      ray_address=args.ray_address, actors=args.actors, actor_cpus=args.actor_cpus,
                      part_images=args.part_images,
                      sha256=args.sha256, trust=args.trust)
    print(json.dumps(summary), file=stdout, flush=True)


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # piped into a program that closes early (`| head`): quiet
    try:
        run_command(argv)
    except Sam3AotiError as e:
        print(f"sam3-aoti: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("sam3-aoti: interrupted", file=sys.stderr)
        sys.exit(130)


BOX_OPTIONS = ("--box", "--negative-box")


def add_request_options(command, boxes_on_type) -> None:
    """What predict and segment are asked: prompts, exemplar boxes and the image they are drawn on, the threshold."""
    command.add_argument("--prompt", action="append", default=[],
                         help="a noun phrase; repeat for several (none with --box: Meta's \"visual\")")
    command.add_argument("--box", action="append", default=[], metavar="X0,Y0,X1,Y1",
                         help="an exemplar box, pixel corners on the image it is drawn on: find things like what it "
                              "holds (repeat)")
    command.add_argument("--negative-box", action="append", default=[], metavar="X0,Y0,X1,Y1",
                         help="an exemplar box of what not to find (repeat)")
    command.add_argument("--boxes-on", type=boxes_on_type, metavar="IMAGE",
                         help="the image the boxes are drawn on (a path or URL), searched for in every image (for "
                              "predict, --image when left out)")
    command.add_argument("--threshold", type=float, default=0.5, help="keep instances scoring at least this (0.5)")


def add_trust_options(command) -> None:
    """How a package is trusted: its digest, or the user's word."""
    command.add_argument("--sha256", help="the package's sha256, as you got it beside or before the package "
                                          "(instead of the .sha256 file beside it)")
    command.add_argument("--trust", action="store_true", help="use a package with no digest to check (it is native "
                                                              "code)")


def boxes_as_values(argv: list[str]) -> list[str]:
    """`--box -5,10,50,60` as `--box=-5,10,50,60`: argparse takes a value that starts with `-` and is no plain
    number for an option, and would say "expected one argument" instead of checking the box."""
    out = []
    for arg in argv:
        if out and out[-1] in BOX_OPTIONS and arg.startswith("-") and (arg[1:2].isdigit() or arg[1:2] == "."):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def run_command(argv: list[str] | None) -> None:
    from . import __version__

    parser = argparse.ArgumentParser(prog="sam3-aoti", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sam3-aoti {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("predict", help="run a package on an image and write an overlay PNG + JSON")
    run.add_argument("package", type=Path, help="the .pt2 archive (artifacts/<profile>/package/sam3.pt2)")
    run.add_argument("--image", type=Path, required=True, help="an RGB image file")
    add_request_options(run, boxes_on_type=Path)
    run.add_argument("--output", type=Path, help="output path without suffix, or a folder to write <image stem>_sam3.* "
                                                 "into (default: <image stem>_sam3)")
    add_trust_options(run)
    many = commands.add_parser("segment", help="a package over a folder, glob, list or bucket prefix of images, on "
                                               "Ray Data, into a resumable Parquet dataset of instances")
    many.add_argument("collection", help="a folder, a glob ('tiles/*.jpg'), a .txt file of paths, or a prefix "
                                         "(s3://bucket/tiles/)")
    source = many.add_mutually_exclusive_group(required=True)
    source.add_argument("--package", type=Path, help="the .pt2 archive")
    source.add_argument("--ref", help="a ref in a binary cache (--cache), pulled and checked on each machine")
    many.add_argument("--cache", help="the binary cache --ref is in: a folder, s3://bucket/prefix or https://")
    many.add_argument("--trusted-key", action="append", default=[], metavar="NAME:BASE64",
                      help="a public key whose signature on --ref is trusted (also $SAM3_AOTI_TRUSTED_KEYS)")
    many.add_argument("--output", type=Path, required=True, help="folder of the Parquet dataset (resumed if it "
                                                                 "holds an interrupted run with the same settings)")
    add_request_options(many, boxes_on_type=str)
    many.add_argument("--batch-size", type=int, default=16, help="images per model call (16)")
    many.add_argument("--actors", type=int, help="model actors (default: one per GPU; one for a CPU package)")
    many.add_argument("--actor-cpus", type=int, help="CPUs a GPU actor holds, the rest decode (default: a quarter "
                                                     "of the CPUs per GPU actor, at most 4)")
    many.add_argument("--ray-address", help="a running Ray cluster (ray://HOST:10001 or auto); default: Ray "
                                            "starts on this machine")
    many.add_argument("--part-images", type=int, default=256,
                      help="images per committed Parquet part: what an interruption can cost (256)")
    add_trust_options(many)
    info = commands.add_parser("info", help="models, backends, inputs/outputs, precision, GPU, versions, sizes")
    info.add_argument("package", type=Path, help="the .pt2 archive")
    info.add_argument("--json", action="store_true", help="print JSON for machines")
    add_trust_options(info)
    get = commands.add_parser("pull", help="a verified package by a signed ref from a binary cache")
    get.add_argument("url", help="the cache: a folder, file://, s3://bucket/prefix or https://")
    get.add_argument("ref", help="the ref a builder published, e.g. sam3-bf16-cuda@NVIDIA-H200")
    get.add_argument("dest", type=Path, help="folder for sam3.pt2, sam3.pt2.sha256, report.json and origin.json")
    get.add_argument("--trusted-key", action="append", default=[], metavar="NAME:BASE64",
                     help="a public key whose signature is trusted (repeat; also $SAM3_AOTI_TRUSTED_KEYS)")
    get.add_argument("--allow-older", action="store_true",
                     help="take a ref issued before one this node pulled already (going back on purpose)")
    cache = commands.add_parser("cache", help="binary cache keys")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True)
    gen = cache_commands.add_parser("keygen", help="write a new ed25519 signing key; print its public key")
    gen.add_argument("name", help="the key's name, e.g. builder-1.example.org (signatures carry it)")
    gen.add_argument("--out", type=Path, required=True, help="file for the secret key (created, mode 600)")
    args = parser.parse_args(boxes_as_values(sys.argv[1:] if argv is None else list(argv)))
    if args.command == "pull":
        pull(args.url, args.ref, args.dest, args.trusted_key, args.allow_older)
        return
    if args.command == "cache":
        keygen(args.name, args.out)
        return
    if args.command == "info":
        show_info(args.package, args.json, args.trust, args.sha256)
        return
    if args.command == "segment":
        run_segment(args)
        return
    boxes = [parse_box(b) for b in args.box] + [parse_box(b) for b in args.negative_box]
    labels = [POSITIVE] * len(args.box) + [NEGATIVE] * len(args.negative_box)
    output = args.output or Path(f"{args.image.stem}_sam3")
    if output.is_dir():  # a folder: the files go inside it, named after the image
        output = output / f"{args.image.stem}_sam3"
    result = predict(args.package, args.image, args.prompt, args.threshold, output, args.trust, args.sha256, boxes,
                     labels, args.boxes_on)
    picture, record = outputs_of(output)
    print(f"{len(result['instances'])} instance(s) in {result['seconds'] * 1000:.0f} ms ({result['backend']}): "
          f"{picture}, {record}")


if __name__ == "__main__":
    main()
