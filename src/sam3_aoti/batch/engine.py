"""`segment` on Ray Data: the collection listed (`sources`), what an earlier run committed left out
(`dataset.Output`), the files read and decoded by CPU tasks (`worker.decode_batch`), batched, segmented by actors
that each load the package once on one GPU (`worker.Segmenter`; CPU actors for a CPU package), their masks
encoded by CPU tasks (`worker.encode_masks`), the results committed by this process, the only writer. Ray retries
the task of an actor that dies (a restarted actor loads the package again); an image is committed once whatever
is retried or resumed.

Ray starts locally on this machine's GPUs (or CPUs) unless `ray_address` names a running cluster. On a cluster
each machine pulls a ref's package itself; the collection must be readable from every machine (a bucket, or a
shared folder), credentials for a bucket included (AWS_* in the workers' environment)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from ..errors import ConfigError, PackageError, Sam3AotiError, first_line

DECODE_BATCH = 4  # images a CPU task reads and decodes at once
GPU_ACTOR_CPUS = 4  # the most CPUs a GPU actor holds (a quarter of the cluster's CPUs per actor at most)
# Ray Data's import (half a second) beside a local Ray's start: on 16 cores the first batch came 0.5 s sooner, on 2
# it came 0.6 s later, the import taking the CPU Ray's starting processes need (benchmarks/README.md, "segment's
# start-up on 16 cores"). Ray starts about six processes: from 8 CPUs on there is room for both.
RAY_DATA_BESIDE_MIN_CPUS = 8
RAYLET_POLL_S, RAYLET_WAIT_S = 0.05, 30.0  # how often a local Ray's start asks for its raylet, and for how long
# The environment of a Ray that segment starts (set before Ray is imported: it reads them once), each unless set:
LOCAL_RAY_ENV = {
    # Under `uv run`, Ray would zip the working directory and start every worker with `uv run` in the copy: a venv of
    # its own (6 GB, ~15 s of CPU a worker), or with --no-sync no Ray at all and a run that hangs. The workers of a
    # Ray on this machine run this interpreter as it is.
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    # Nor usage statistics: an offline GPU box has no one to send them to, and Ray Data's collection of them (a
    # driver thread polling every 10 s, a call to its actor as a run ends) calls into Ray after the last batch, where
    # a call after ray.shutdown ends the process with exit 1 (a likely cause of one such exit in CI, after every row
    # was written).
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray's processes connect to a local socket by trying, then sleeping a whole second before the next try. The
    # raylet's first try at its own object store's socket, made as the store starts, loses that race in about half
    # the starts, and ray.init then takes 3.4 s where 2.4 would do (benchmarks/cpu-2026-12-07-ray-connect/). The
    # same 10 s in all, in tenths of a second.
    "RAY_raylet_client_connect_timeout_milliseconds": "100",
    "RAY_raylet_client_num_connect_attempts": "100",
}


def batch_extra(module: str):
    """A module of the `batch` extra, or the one-line error that says how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"segment needs the `batch` extra ({module} is missing): pip install 'sam3-aoti[batch]'") \
            from None


def worker_error(e: BaseException) -> Sam3AotiError:
    """This project's one-line error a worker raised, found under Ray's wrappers (each holds what it wraps as
    `cause`); else one line naming Ray's."""
    seen = e
    for _ in range(16):
        cause = getattr(seen, "cause", None) or seen.__cause__
        if cause is None:
            break
        if isinstance(cause, Sam3AotiError) and not hasattr(cause, "cause"):
            return cause
        seen = cause
    return PackageError(f"segment failed in a Ray worker ({first_line(e)}): the run so far is kept, run it again")


def say(line: str) -> None:
    print(f"sam3-aoti segment: {line}", file=sys.stderr, flush=True)


def package_identity(package: str | None, ref: str | None, cache: str | None, trusted: list[str],
                     sha256: str | None, trust: bool) -> tuple[object, Path, str]:
    """(what each actor is given to load, a local copy to read the metadata from, the package's sha256). A ref is
    pulled here first, checked as `pull` checks it: the run is bound to the sha256 it names now."""
    from ..runtime.files import sha256_once
    from ..runtime.integrity import digest_file, normalize_digest, read_digest_file

    if ref:
        from ..cache.binary_cache import pull_once
        from ..cache.signing import trusted_keys
        from .worker import pulled_packages

        if not cache:
            raise ConfigError(f"--ref {ref} names a package in a binary cache: pass --cache URL too")
        dest = pull_once(cache, ref, pulled_packages(), trusted_keys(trusted))
        digest = dest.name  # the sha256 the signed ref names: what the package is checked against
        return {"cache": cache, "ref": ref, "trusted": list(trusted), "sha256": digest}, dest / "sam3.pt2", digest
    path = Path(package).absolute()
    if sha256:
        digest = normalize_digest(sha256)
    elif digest_file(path).is_file():
        digest = read_digest_file(digest_file(path))
    else:
        digest = sha256_once(path) if trust and path.is_file() else None
    return str(path), path, digest


def segment(collection: str, output: Path, prompts: list[str], package: str | None = None, *, ref: str | None = None,
            cache: str | None = None, trusted: list[str] = (), threshold: float = 0.5, boxes: list = (),
            labels: list = (), boxes_on: str | None = None, batch_size: int = 16, ray_address: str | None = None,
            actors: int | None = None, actor_cpus: int | None = None, part_images: int = 256,
            sha256: str | None = None, trust: bool = False) -> dict:
    """Segment every image of `collection` into `output` (`dataset`); returns the run's summary."""
    from ..runtime.contract import VISUAL_PROMPT
    from ..runtime.info import archive_info
    from .dataset import Output, new_run_id
    from .sources import list_sources

    from ..runtime.inference import check_request

    if ray_address is None:  # the Ray this run starts
        for name, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(name, value)
    for module in ("ray", "pyarrow", "pycocotools"):
        batch_extra(module)
    from ..runtime.files import bytecode_advice

    if advice := bytecode_advice("torch"):  # each model actor would pay it before its first batch
        say(advice)
    check_request(prompts, boxes, threshold, boxes_on)  # one line now, not a trace from every actor
    if min(batch_size, part_images, 1 if actors is None else actors, 1 if actor_cpus is None else actor_cpus) < 1:
        raise ConfigError(f"batch size {batch_size}, images per part {part_images}, actors {actors} and CPUs per "
                          f"actor {actor_cpus} must each be 1 or more (--batch-size, --part-images, --actors, "
                          "--actor-cpus)")
    if ref and not cache:
        raise ConfigError(f"{ref} names a package in a binary cache: give the cache too (--cache URL)")
    if boxes and not boxes_on:
        raise ConfigError("--box corners are pixels of one image: name it with --boxes-on IMAGE (its exemplars "
                          "are searched for in every image of the collection)")
    t0 = time.perf_counter()
    unlisted: list = []  # what the listing left out, and why: the run's first error rows
    sources = list_sources(collection, unlisted)
    if boxes:  # checked here, in one line, not in every actor
        from ..runtime.exemplars import normalized_boxes
        import hashlib
        import io

        from ..runtime.images import decode_image
        from .sources import is_url, read_source

        boxes_on = boxes_on if is_url(boxes_on) else str(Path(boxes_on).absolute())
        data = read_source(boxes_on)
        exemplar_sha256 = hashlib.sha256(data).hexdigest()  # the exemplars are its pixels: settings name its content
        drawn_on = decode_image(io.BytesIO(data), boxes_on)
        normalized_boxes(list(boxes), list(labels), drawn_on.shape[1], drawn_on.shape[0])
    run = new_run_id()
    spec, local, digest = package_identity(package, ref, cache, list(trusted), sha256, trust)
    info = archive_info(local, trust=trust, sha256=digest)  # one line now for a bad package, not one per actor
    device = info["device"] or "cpu"
    settings = {"package_sha256": digest, "prompts": list(prompts) or [VISUAL_PROMPT], "threshold": threshold,
                "boxes": [list(b) for b in boxes], "labels": list(labels), "boxes_on": boxes_on,
                **({"boxes_on_sha256": exemplar_sha256} if boxes else {})}
    out = Output(output, settings, part_images, run)
    for part in out.damaged:
        say(f"{part}: damaged, removed; its images are segmented again")
    try:
        if unlisted:
            out.add(error_rows(unlisted))
        todo = [s for s in sources if s not in out.done]
        say(f"{len(sources)} images in {collection}: {len(sources) - len(todo)} done by an earlier run, "
            f"{len(todo)} to segment")
        ran = {"actors": 0, "actor_cpus": None, "first_at": None, "after_first": 0, "busy_after_first": 0.0,
               "ray_at": None, "ray_up_at": None, "executing_at": None}
        if todo:
            ran = _run_on_ray(todo, out, device, ray_address, actors, actor_cpus, batch_size, dict(
                package=spec, prompts=list(prompts), threshold=threshold, boxes=[list(b) for b in boxes],
                labels=list(labels), boxes_on=boxes_on, sha256=None if isinstance(spec, dict) else digest,
                trust=trust, boxes_on_sha256=settings.get("boxes_on_sha256"), batch_size=batch_size))
    finally:
        out.close()
    seconds = time.perf_counter() - t0
    first = ran["first_at"] - t0 if ran["first_at"] else None
    running = seconds - first if first is not None else None  # from the first results on: Ray up, packages loaded
    startup = None  # where the time until the first results went
    if first is not None:
        startup = {"listing_and_checks_s": round(ran["ray_at"] - t0, 2),
                   "ray_start_s": round(ran["ray_up_at"] - ran["ray_at"], 2),
                   "ray_data_s": round(ran["executing_at"] - ran["ray_up_at"], 2),
                   "actors_and_first_batch_s": round(ran["first_at"] - ran["executing_at"], 2)}
    summary = {"run": out.run, "images": len(sources), "segmented": out.written, "failed": out.failed,
               "skipped": len(sources) - len(todo), "actors": ran["actors"], "actor_cpus": ran["actor_cpus"],
               "seconds": round(seconds, 2),
               "first_result_s": round(first, 2) if first is not None else None, "startup": startup,
               "images_per_second": round(out.written / seconds, 3) if seconds else None,
               "steady_images_per_second": round(ran["after_first"] / running, 3) if running else None,
               # the calls an actor had in flight, on average over the running span: at most one call at a time
               # (a CPU actor) or two (a GPU actor's overlapping calls); below that, the actors waited for batches
               "actor_calls_in_flight": round(ran["busy_after_first"] / (running * ran["actors"]), 3)
               if running and ran["actors"] else None}
    say(f"{out.written} segmented, {out.failed} could not be read (see {Path(output) / 'errors'}), "
        f"{summary['skipped']} done before, in {seconds:.1f} s")
    return summary


def error_rows(problems: list):
    """(name, reason) pairs as the rows of images that could not be segmented."""
    import pyarrow as pa

    from .schemas import segmented_schema

    return pa.Table.from_pylist([{"source": name, "width": 0, "height": 0, "error": reason, "seconds": 0.0,
                                  "instances": []} for name, reason in problems], schema=segmented_schema())


def _run_on_ray(todo: list[str], out, device: str, ray_address: str | None, actors: int | None,
                actor_cpus: int | None, batch_size: int, segmenter: dict) -> dict:
    """The run through Ray Data, its results into `out`; returns how many model actors ran, when Ray was asked for
    and was up (`ray_at`, `ray_up_at`), when Ray Data was asked to run the pipeline (`executing_at`: after its import
    and the plan), when the first results came (`first_at`; perf_counter, all) and how many images came after them."""
    ray_at = time.perf_counter()
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        start_ray(ray, ray_address)
    ray_up_at = time.perf_counter()
    with stopped_by_signals(ray if started_here else None):
        ran = _run_with_ray(ray, todo, out, device, actors, actor_cpus, batch_size, segmenter)
    return {**ran, "ray_at": ray_at, "ray_up_at": ray_up_at}


def start_ray(ray, address: str | None, data_beside: bool | None = None, **options) -> None:
    """`ray.init`, a local Ray or `address`'s cluster, with Ray Data imported in a thread meanwhile (`data_beside`;
    default: when joining a cluster, or where this machine has RAY_DATA_BESIDE_MIN_CPUS CPUs for Ray's starting
    processes and the import alike). The import follows Ray's start otherwise, on the path to the first results.
    `options` go to `ray.init` as they are (experiments/ray_start.py's CPU count and Ray system config)."""
    import threading

    if data_beside is None:
        data_beside = address is not None or (os.cpu_count() or 1) >= RAY_DATA_BESIDE_MIN_CPUS
    beside = threading.Thread(target=_import_quietly, args=("ray.data",), daemon=True) if data_beside else None
    if beside:
        beside.start()
    try:
        with raylet_awaited_briskly(local=address is None):
            ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False,
                     **options)
    except Exception as e:  # ConnectionError for an address nothing answers on, and Ray's own
        raise ConfigError(f"cannot start or reach Ray{f' at {address}' if address else ''} ({first_line(e)})") \
            from None
    finally:
        if beside:
            beside.join()


@contextlib.contextmanager
def raylet_awaited_briskly(local: bool):
    """Within, a local Ray's start learns of its raylet within RAYLET_POLL_S of the raylet's registration. Ray's
    driver asks GCS for its raylet 0.1 s after starting it, and on a miss sleeps a whole second before asking again
    (`GlobalStateAccessor::GetNode`, a fixed second in Ray 2.60), while the raylet takes about a second to register
    (it waits for its dashboard agent's start): up to a second lost, half of one on average. Ray's own call then
    follows a cheap poll of GCS's node table, and finds its raylet at once. Where Ray's private names differ, Ray's
    own wait stands."""
    try:
        from ray._private import services, state
    except ImportError:
        services = state = None
    original = getattr(services, "get_node", None)
    options = getattr(services, "_get_gcs_client_options", None)
    if not local or original is None or options is None or not hasattr(state, "GlobalState"):
        yield
        return

    def get_node(gcs_address, node_id):
        with contextlib.suppress(Exception):  # whatever fails here, Ray's own call below waits and says why
            nodes = state.GlobalState()
            nodes._initialize_global_state(options(gcs_address))
            deadline = time.monotonic() + RAYLET_WAIT_S
            while time.monotonic() < deadline and not any(
                    n.get("NodeID") == node_id and n.get("Alive") for n in nodes.node_table()):
                time.sleep(RAYLET_POLL_S)
        return original(gcs_address, node_id)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = original


def _import_quietly(module: str) -> None:
    """Import `module` for later; should it fail, the import where it is used says why."""
    import importlib

    with contextlib.suppress(Exception):
        importlib.import_module(module)


@contextlib.contextmanager
def stopped_by_signals(ray):
    """Ctrl-C or SIGTERM to the driver ends the run as an interrupt (what came back is committed; exit 130), and
    `ray` (the Ray this run started, not a cluster it joined) is shut down with it, on every way out."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    import threading

    here = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    before = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)} if here else {}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        if ray is not None:
            ray.shutdown()


def _run_with_ray(ray, todo: list[str], out, device: str, actors: int | None, actor_cpus: int | None,
                  batch_size: int, segmenter: dict) -> dict:
    from .worker import OverlappingSegmenter, Segmenter, decode_batch, encode_masks

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    images = ray.data.from_items([{"source": s} for s in todo],
                                 override_num_blocks=max(1, min(len(todo) // DECODE_BATCH, 1000)))
    decoded = images.map_batches(decode_batch, batch_size=DECODE_BATCH, batch_format="numpy", num_cpus=1)
    segmented, actors, actor_cpus = on_model_actors(ray, decoded, OverlappingSegmenter if device == "cuda" else
                                                    Segmenter, segmenter, device, actors, batch_size, actor_cpus)
    # the masks' bits into COCO counts in CPU tasks: the model actor's CPU does nothing its GPU waits on
    found = segmented.map_batches(encode_masks, batch_size=None, batch_format="pyarrow", num_cpus=1)
    t0, last, first, after_first, busy = time.perf_counter(), 0.0, None, 0, 0.0
    try:
        for table in found.iter_batches(batch_format="pyarrow", batch_size=None):
            if first is None:
                first = time.perf_counter()
            else:
                after_first += table.num_rows
                busy += sum(table.column("seconds").to_pylist())  # each image's share of its call
            out.add(table)
            if time.perf_counter() - last > 10:
                last = time.perf_counter()
                done = out.written + out.pending_images
                say(f"{done} of {len(todo)} images ({done / max(last - t0, 1e-9):.1f}/s), "
                    f"{out.failed} unreadable")
    except KeyboardInterrupt:
        out.flush()  # what came back is committed: the next run goes on from there
        raise
    except Exception as e:  # Ray's wrapper around what failed in a worker: the worker's own one line if it has one
        out.flush()  # what came back is committed: the next run goes on from there
        raise worker_error(e) from None
    out.flush()
    return {"actors": actors, "actor_cpus": actor_cpus, "executing_at": t0, "first_at": first,
            "after_first": after_first, "busy_after_first": busy}


def on_model_actors(ray, decoded, model: type, kwargs: dict, device: str, actors: int | None, batch_size: int,
                    actor_cpus: int | None = None):
    """`decoded` through `model(**kwargs)` in a pool of actors: for a CUDA package one per GPU of the cluster unless
    `actors` says otherwise, each holding one GPU (Ray gives each its own in CUDA_VISIBLE_DEVICES, so the package's
    "cuda" is that GPU and no GPU holds two copies) and `actor_cpus` CPUs (default: a quarter of the cluster's CPUs
    per actor, at most GPU_ACTOR_CPUS); for a CPU package, CPU actors (default one) of one CPU. Returns the dataset,
    the actor count and each actor's CPUs."""
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    if device == "cuda" and not gpus:
        raise ConfigError("the package is for cuda and the Ray cluster has no GPU: run where GPUs are, or segment "
                          "with a device=cpu package")
    actors = actors or (gpus if device == "cuda" else 1)
    cpus = int(resources.get("CPU", 1))
    if device != "cuda":
        actor_cpus = 1
    elif actor_cpus is None:
        actor_cpus = max(1, min(GPU_ACTOR_CPUS, cpus // (4 * actors)))
    elif actor_cpus * actors >= cpus:
        raise ConfigError(f"{actors} actor(s) of {actor_cpus} CPUs leave none of the cluster's {cpus} for the "
                          "decoding: give --actor-cpus fewer")
    say(f"Ray {ray.__version__}: {actors} {'GPU' if device == 'cuda' else 'CPU'} actor(s) of {actor_cpus} CPU(s), "
        f"{cpus} CPUs in all for them and the decoding, batches of {batch_size}")
    # On a GPU, batches queue at each actor (their pixels are there when the model is free: Ray's pattern for batch
    # inference) and two calls overlap on the actor's event loop (`OverlappingSegmenter`): one call at a time left
    # the GPU idle while the actor's Python ran, 36 % of the time under Ray (benchmarks/h100-2026-12-05-segment-busy/).
    # Each GPU actor holds a few CPUs: Ray starts it with as many OpenMP threads (the pixels' staging copy: 1.60 ms an
    # image with one thread, 0.98 with four), and the decoding tasks leave them to it.
    pool = ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=4, max_concurrent_calls_per_actor=2) \
        if device == "cuda" else ray.data.ActorPoolStrategy(size=actors)
    found = decoded.map_batches(model, fn_constructor_kwargs=kwargs, batch_size=batch_size, batch_format="pyarrow",
                                compute=pool, num_gpus=1 if device == "cuda" else 0, num_cpus=actor_cpus)
    return found, actors, actor_cpus
