"""The binary cache on the doit side: input-addressed keys, substitution, pushes (`cache.binary_cache`).

A stage's key is a hash of what its outputs are made from, computed without running anything: its
fingerprint (its pipeline.toml table, profile, device, precision, versions), the content of every library
module it imports, the keys of the stages it reads (derivation-style), and for the compiles the toolchain's
facts; a user's checkpoint and the verify cases by content. So a machine knows the key of the package and
of its verify report before any weights or export exist here. The compiles are also keyed by content: the
program digest (program.json, parts.json) instead of the export's key, so new weights of the same architecture
substitute the compiled code on every box.

When doit loads with `cache=URL`, the package, its verify report and its pictures are substituted top-down
(the package first; verify and render only on top of a substituted package), before the graph is built:
a substituted stage's task reads nothing upstream, so weights, export and compile are not run. Anything
refused (unsigned, untrusted, altered, a blob that does not match, the server gone) is one line and the
stage builds here instead. After a stage builds, its outputs are pushed when SAM3_AOTI_SIGNING_KEY is set.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from doit import get_var

from sam3_aoti.errors import Sam3AotiError
from sam3_aoti.pipeline.artifacts import manifest_changes, mark, read_manifest, record
from sam3_aoti.pipeline.paths import DEFAULT_CASES
from sam3_aoti.runtime.files import sha256_once  # once per process and state of a file (a checkpoint: once a load)

from . import PATHS, ROOT, SETTINGS, sources, weights_inputs

KEY_FORMAT = "sam3-aoti-key/1"
PARTS = ("export_parts", "compile_parts") if SETTINGS.split else ()  # the stages of the model in parts
INPUTS = {"weights": (), "export": ("weights",), "fallback": ("weights", "export"), "compile": ("export",),
          **({"export_parts": ("weights",), "compile_parts": ("export_parts",)} if SETTINGS.split else {}),
          "package": ("weights", "export", "fallback", "compile", *PARTS), "verify": ("package",),
          "render": ("package",)}
COMPILES = ("compile", "compile_parts")  # keyed by content: their program digest (ProfilePaths.compiled_archive)
# What a cache holds: weights and the exports are rebuilt from inputs.
CACHED = ("compile", *PARTS[1:], "package", "verify", "render")
TABLES = {"export_parts": ("export",), "compile_parts": ("compile",)}  # pipeline.toml tables beside the stage's own
SUBSTITUTED_AT_LOAD = ("package", "verify", "render")  # top-down; compile substitutes by content when it runs


def say(line: str) -> None:
    print(f"sam3-aoti cache: {line}", file=sys.stderr, flush=True)


def units(stage: str) -> list[str]:
    """What a stage's cache entry holds, relative to the variant's folder (files, or folders taken whole)."""
    paths = {**{name: [PATHS.compiled_archive(name).folder] for name in COMPILES},
             "package": [PATHS.package, PATHS.fallback_package, *map(_digest_file, [PATHS.package, PATHS.fallback_package])],
             "verify": [PATHS.verify_report_json, PATHS.verify_report_md, PATHS.verify_report_html],
             "render": [PATHS.render_dir]}[stage]
    return [str(p.relative_to(PATHS.root)) for p in paths]


def recorded_outputs(stage: str) -> list[Path]:
    """What the stage itself records in the manifest (a compile: its index; the folder is checked through it)."""
    return [PATHS.root / u / "index.json" for u in units(stage)] if stage in COMPILES else [
        PATHS.root / u for u in units(stage)]


def _digest_file(path: Path) -> Path:
    from sam3_aoti.runtime.integrity import digest_file

    return digest_file(path)


# --- keys -------------------------------------------------------------------------------------------------------

def digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@functools.cache
def toolchain_facts() -> dict:
    """The facts `toolchain` writes to cuda.env, gathered the same way (a second, no torch import)."""
    from sam3_aoti.toolchain.facts import build_facts, gather

    with tempfile.TemporaryDirectory(prefix="sam3-aoti-facts-") as scratch:
        report, _ = gather(SETTINGS.device, SETTINGS.toolkit, os.environ, Path(scratch))
    return build_facts(report)


def cases_digest() -> dict:
    from sam3_aoti.pipeline.cases import case_entries
    from sam3_aoti.pipeline.settings import package_version

    images = {}
    for _, entry in case_entries(DEFAULT_CASES):
        image = entry.get("image", "")
        if image.startswith("skimage:"):
            images[image] = f"scikit-image {package_version('scikit-image')}"
        elif image:
            images[image] = sha256_once((DEFAULT_CASES.parent / image).resolve())
    return {"cases.toml": sha256_once(DEFAULT_CASES), "images": images}


def _common(stage: str) -> dict:
    fingerprint = SETTINGS.fingerprint(stage, *TABLES.get(stage, ()))
    if stage in COMPILES:
        fingerprint.update(tuned=SETTINGS.tuned, tune=SETTINGS.stage("tune") if SETTINGS.tuned else None)
    return {"format": KEY_FORMAT, "stage": stage, "fingerprint": fingerprint,
            "python": ".".join(platform.python_version_tuple()[:2]),
            "sources": {str(Path(f).relative_to(ROOT)): sha256_once(f) for f in sources(stage)}}


@functools.cache
def derivation_key(stage: str) -> str:
    body = {**_common(stage), "inputs": {name: derivation_key(name) for name in INPUTS[stage]}}
    if stage == "weights":
        body["checkpoint"] = ({str(p.name): sha256_once(p) for p in weights_inputs(SETTINGS.weights)}
                              if SETTINGS.weights != "random" else "random")
    if stage in COMPILES:
        body["toolchain"] = toolchain_facts()
    if stage in ("verify", "render"):
        body["cases"] = cases_digest()
    return digest(body)


def compile_content_key(stage: str) -> str:
    """A compile by what it compiles: its program digest, not the weights' key (its export must have run)."""
    program = json.loads(PATHS.compiled_archive(stage).digest.read_text())["sha256"]
    return digest({**_common(stage), "program_sha256": program, "toolchain": toolchain_facts()})


def key_of(stage: str) -> str:
    return compile_content_key(stage) if stage in COMPILES else derivation_key(stage)


# --- the cache of this run ----------------------------------------------------------------------------------------

def ref_names() -> list[str]:
    """The refs a verified push publishes: `<variant>@<machine>` and the user's `ref=NAME`."""
    from sam3_aoti.pipeline.settings import gpu_model

    machine = gpu_model() if SETTINGS.device == "cuda" else f"cpu-{platform.machine()}"
    names = [f"{SETTINGS.variant}@{(machine or 'unknown-gpu').replace(' ', '-')}"]
    return names + ([get_var("ref")] if get_var("ref") else [])


@functools.cache
def open_cache():
    """The cache of this run (`cache=URL`, else [cache] url), or None. A bad URL, key or setting is one line
    and the run goes on without the cache."""
    url = get_var("cache") or SETTINGS.stage("cache").get("url") or ""
    if url in ("", "none", "off"):
        return None
    from sam3_aoti.cache.binary_cache import Cache
    from sam3_aoti.cache.signing import SIGNING_KEY_VARIABLE, SecretKey, trusted_keys

    try:
        secret = SecretKey.read(os.environ[SIGNING_KEY_VARIABLE]) if os.environ.get(SIGNING_KEY_VARIABLE) else None
        return Cache(url, trusted_keys(SETTINGS.stage("cache").get("trusted_keys", [])), secret)
    except Sam3AotiError as e:
        say(f"not used in this run: {e}")
        return None


def pushes(stage: str) -> bool:
    cache = open_cache()
    return bool(cache and cache.secret and cache.store.writable
                and stage in SETTINGS.stage("cache").get("push", list(CACHED)))


def substitute(stage: str, key: str) -> bool:
    """The stage's outputs for `key` from the cache, checked, in place and recorded; False (one line why) when
    the cache has none, or none it may take."""
    from sam3_aoti.cache.binary_cache import Refused
    from sam3_aoti.cache.store import StoreError

    cache = open_cache()
    t0 = time.monotonic()
    try:
        found = cache.entry(stage, key)
        if found is None:
            say(f"{stage}: not in {cache.url} (key {key[:12]}): builds here")
            return False
        entry, signed_by = found
        cache.fetch(entry, PATHS.root, units(stage), progress=lambda line: say(f"{stage}: {line}"))
    except (Refused, StoreError) as e:
        say(f"{stage}: {e}; builds here instead")
        return False
    origin = {"substituted": cache.url, "signed_by": signed_by, "built_by": entry.get("built_by")}
    record(PATHS.manifest, stage, recorded_outputs(stage), {**entry.get("info", {}), "key": key, "origin": origin})
    if stage == "package":
        mark(PATHS.manifest, "verify", verified=False)  # until a verify of this package is here
    size = sum(o["bytes"] for o in entry["outputs"].values())
    say(f"{stage}: substituted from {cache.url}, signed by {signed_by} ({size / 2**20:.0f} MB in "
        f"{time.monotonic() - t0:.1f} s)")
    return True


def intact(stage: str, key: str) -> bool:
    """A stage substituted for `key` whose outputs (and the package it read) are still as they came."""
    entry = read_manifest(PATHS.manifest)["stages"].get(stage, {})
    reads = ["package"] if stage in ("verify", "render") else []
    return (entry.get("key") == key and "substituted" in entry.get("origin", {}) and entry.get("verified") is not False
            and not manifest_changes(PATHS.manifest, [stage, *reads]))


@functools.cache
def substituted() -> dict[str, str]:
    """stage -> key of the stages whose outputs here are substituted ones for today's key (fetched now, when
    this command may write and a cache is set): their tasks then read nothing upstream."""
    stages = read_manifest(PATHS.manifest)["stages"]
    had = any("substituted" in stages.get(s, {}).get("origin", {}) for s in SUBSTITUTED_AT_LOAD)
    cache = open_cache() if _may_write() else None
    if not (had or cache):
        return {}
    try:
        done = {}
        for stage in SUBSTITUTED_AT_LOAD:
            if stage != "package" and "package" not in done:
                break
            key = derivation_key(stage)
            if intact(stage, key) or (cache and not _built_here(stage, key) and substitute(stage, key)):
                done[stage] = key
        return done
    except Sam3AotiError as e:  # the toolchain's facts could not be gathered: nothing is substituted
        say(f"not used in this run: {e}")
        return {}


def _built_here(stage: str, key: str) -> bool:
    """A stage built here for today's key, intact: nothing to fetch."""
    entry = read_manifest(PATHS.manifest)["stages"].get(stage, {})
    return entry.get("key") == key and not manifest_changes(PATHS.manifest, [stage])


def _may_write() -> bool:
    from .runs import may_write_now

    return may_write_now()


# --- after a build --------------------------------------------------------------------------------------------------

def files_of(stage: str) -> dict[str, Path]:
    found = {}
    for unit in units(stage):
        path = PATHS.root / unit
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file():
                found[str(file.relative_to(PATHS.root))] = file
    return found


def entry_info(stage: str) -> dict:
    """What the builder recorded of the stage (options, versions, timings), without local file facts."""
    entry = read_manifest(PATHS.manifest)["stages"].get(stage, {})
    return {k: v for k, v in entry.items() if k not in ("outputs", "finished", "origin", "key")}


def built(stage: str) -> None:
    """Record a stage built here with its key, and push it where this run pushes (a failed push is one line: the
    build here stands)."""
    from sam3_aoti.cache.binary_cache import Refused
    from sam3_aoti.cache.store import StoreError

    key = key_of(stage)
    mark(PATHS.manifest, stage, key=key, origin={"built": platform.node()})
    if not pushes(stage):
        return
    cache = open_cache()
    t0 = time.monotonic()
    try:
        cache.push_entry(stage, key, files_of(stage), entry_info(stage), progress=lambda line: say(f"{stage}: {line}"))
        say(f"{stage}: pushed to {cache.url} (key {key[:12]}, {time.monotonic() - t0:.1f} s)")
        if stage == "verify" and entry_info("verify").get("verified") is True:
            publish_refs(cache)
    except (Sam3AotiError, Refused, StoreError) as e:
        say(f"{stage}: push failed ({e}); the build here is unaffected")


def publish_refs(cache) -> None:
    files = {"sam3.pt2": PATHS.package, "sam3.pt2.sha256": _digest_file(PATHS.package),
             "report.json": PATHS.verify_report_json}
    info = {"verified": True, "variant": SETTINGS.variant, "package_key": derivation_key("package"),
            "verify_key": derivation_key("verify"), "precision": SETTINGS.precision, "device": SETTINGS.device,
            "versions": {name: entry_info("package").get(name) for name in ("torch", "transformers")}}
    for name in ref_names():
        cache.push_ref(name, files, info)
        say(f"ref {name} -> this verified package, in {cache.url}")


def push_built():
    """`doit push`: every cached stage built here for today's key, then the refs of its verified package."""
    from doit.action import TaskFailed

    cache = open_cache()
    if cache is None or not cache.secret or not cache.store.writable:
        return TaskFailed("push needs cache=URL (a folder or s3://) and SAM3_AOTI_SIGNING_KEY=KEYFILE")
    stages = read_manifest(PATHS.manifest)["stages"]
    done = []
    try:
        for stage in CACHED:
            entry = stages.get(stage, {})
            if entry.get("key") and entry["key"] == key_of(stage) and not manifest_changes(PATHS.manifest, [stage]):
                cache.push_entry(stage, entry["key"], files_of(stage), entry_info(stage))
                done.append(stage)
        if "verify" in done and stages["verify"].get("verified") is True:
            publish_refs(cache)
    except Sam3AotiError as e:  # the store gone, its bucket missing, a full disk, a read-only folder
        return TaskFailed(f"push failed after {', '.join(done) or 'nothing'}: {e}")
    if not done:
        return TaskFailed("nothing built here is up to date for today's keys: run `uv run doit` first")
    say(f"pushed {', '.join(done)} to {cache.url}")
    return None
