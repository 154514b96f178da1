"""Every path of the build, in one place: the checkout's inputs, each variant's generated files (variants of
profile, precision and device never share a folder) and the machine's toolchain folder. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..runtime.archive import MODEL_NAMES, PART_NAMES, fallback_of

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CONFIG = REPO_ROOT / "pipeline.toml"
DEFAULT_CASES = REPO_ROOT / "cases.toml"
PIN_TABLE = REPO_ROOT / "env" / "toolchain.toml"  # torch's CUDA line -> the pinned toolkit wheels
ROOT_VARIABLE = "SAM3_AOTI_ROOT"  # how files under artifacts/ name the checkout: a copy of it stays whole


def portable(value: str | None) -> str | None:
    """A path string with the checkout's own prefix as `$SAM3_AOTI_ROOT`, so that no file under artifacts/
    points into another checkout once this one is copied or moved (`resolve_portable` undoes it)."""
    if not value:
        return value
    for root in dict.fromkeys([str(REPO_ROOT), str(REPO_ROOT.resolve())]):
        if value == root or value.startswith(root + "/"):
            return f"${ROOT_VARIABLE}{value[len(root):]}"
    return value


def resolve_portable(value: str) -> str:
    return value.replace(f"${ROOT_VARIABLE}", str(REPO_ROOT))


def space_free(path: Path) -> Path:
    """`path`, or a link to it whose own path has no whitespace: torch's C++ build line quotes include folders
    but not sources, outputs or library folders, so a compile under a path with a space fails. The link lives
    in this user's cache (else the temp folder), named by a hash of `path`."""
    import hashlib
    import os
    import tempfile
    import threading

    if not any(c.isspace() for c in str(path)):
        return path
    from ..runtime.scratch import cache_dir

    base = cache_dir() / "links"
    if any(c.isspace() for c in str(base)):
        base = Path(tempfile.gettempdir()) / f"sam3-aoti-{os.getuid()}" / "links"
    link = base / hashlib.sha256(str(path).encode()).hexdigest()[:16]
    base.mkdir(parents=True, exist_ok=True)
    if not (link.is_symlink() and Path(os.readlink(link)) == path):
        tmp = base / f".{link.name}.{os.getpid()}.{threading.get_ident()}"  # the probe's thread links beside compile's
        tmp.unlink(missing_ok=True)
        os.symlink(path, tmp)
        os.replace(tmp, link)
    return link


class CompiledArchive(NamedTuple):
    """What one compile stage reads and writes: the exported archive, the programs it must hold, their digest (the
    compile's key) and the folder of AOTInductor's files."""
    archive: Path
    programs: tuple[str, ...]
    digest: Path
    folder: Path


@dataclass(frozen=True)
class ToolchainPaths:
    """`artifacts/toolchain/`: one per machine and checkout, shared by every variant."""
    root: Path

    @classmethod
    def of(cls, settings) -> "ToolchainPaths":
        return cls(settings.artifacts_root / "toolchain")

    @property
    def env_file(self) -> Path:
        """cuda.env: the toolkit, a fix if one was needed, and the build facts (toolchain.cuda_env)."""
        return self.root / "cuda.env"

    @property
    def doctor(self) -> Path:
        return self.root / "doctor.json"

    @property
    def probe_report(self) -> Path:
        """The AOTI probe's verdict for the cuda.env it ran with (stages.probe, run before a real compile)."""
        return self.root / "probe.json"

    @property
    def probe_env(self) -> Path:
        """A fix the probe found, applied after cuda.env for every stage after it."""
        return self.root / "probe.env"


@dataclass(frozen=True)
class ProfilePaths:
    root: Path  # artifacts/<profile>-<precision>-<device>

    @classmethod
    def of(cls, settings) -> "ProfilePaths":
        return cls(settings.artifacts_root / settings.variant)

    @property
    def checkpoint(self) -> Path:
        """HF-format checkpoint folder: config.json + model.safetensors."""
        return self.root / "weights" / "checkpoint"

    @property
    def checkpoint_files(self) -> list[Path]:
        return [self.checkpoint / "config.json", self.checkpoint / "model.safetensors"]

    @property
    def tokenizer_merges(self) -> Path:
        """CLIP BPE merges for the archive: the checkpoint's own, or the bundled ones."""
        return self.root / "weights" / "tokenizer_merges.txt"

    @property
    def exported(self) -> Path:
        """The exported programs `model` and `transforms` with their weights, in one PT2 archive."""
        return self.root / "export" / "programs.pt2"

    @property
    def exported_parts(self) -> Path:
        """The model in parts (`[export] split`: encode_image, encode_text, encode_boxes, decode) with their weights,
        exported by a stage of its own beside `model`'s compile."""
        return self.root / "export" / "parts.pt2"

    @property
    def exported_portable(self) -> Path:
        """Every program (model, its parts, transforms) exported with this project's custom ops as the torch ops
        they compute (`model.ops`): the package's fallback, which loads where torch alone is installed."""
        return self.root / "export" / "programs.portable.pt2"

    @property
    def fallback_drift(self) -> Path:
        """The fallback's drift against eager, measured by its own stage beside the compile, for verify."""
        return self.root / "export" / "fallback_drift.json"

    @property
    def program_digest(self) -> Path:
        """What the compiled code depends on: graphs, signatures, weight layouts; not the weights' values."""
        return self.root / "export" / "program.json"

    @property
    def parts_digest(self) -> Path:
        """The parts' program digest, as `program_digest` is model's and transforms'."""
        return self.root / "export" / "parts.json"

    @property
    def compiled(self) -> Path:
        """AOTInductor's files per model, without weights: reused while program.json stays the same."""
        return self.root / "compiled"

    @property
    def compiled_index(self) -> Path:
        return self.compiled / "index.json"

    @property
    def compiled_parts(self) -> Path:
        """The parts' AOTInductor files (`compile_parts`), reused while parts.json stays the same."""
        return self.root / "compiled_parts"

    @property
    def compiled_parts_index(self) -> Path:
        return self.compiled_parts / "index.json"

    def compiled_archive(self, stage: str) -> CompiledArchive:
        """`compile`'s (model and transforms) or `compile_parts`' (the parts) inputs and outputs."""
        if stage == "compile":
            return CompiledArchive(self.exported, MODEL_NAMES, self.program_digest, self.compiled)
        return CompiledArchive(self.exported_parts, PART_NAMES, self.parts_digest, self.compiled_parts)

    @property
    def tuning(self) -> Path:
        """Inductor's autotuning results for this variant's graph on this GPU (`tune`), read by `compile`."""
        return self.root / "tuning"

    @property
    def tuning_index(self) -> Path:
        return self.tuning / "index.json"

    @property
    def package(self) -> Path:
        return self.root / "package" / "sam3.pt2"

    @property
    def fallback_package(self) -> Path:
        return fallback_of(self.package)

    @property
    def verify_report_json(self) -> Path:
        return self.root / "verify" / "report.json"

    @property
    def verify_report_md(self) -> Path:
        return self.root / "verify" / "report.md"

    @property
    def verify_report_html(self) -> Path:
        return self.root / "verify" / "report.html"

    @property
    def render_dir(self) -> Path:
        return self.root / "render"

    @property
    def render_index(self) -> Path:
        return self.render_dir / "index.md"

    @property
    def reference_cache(self) -> Path:
        """Eager outputs on verify's inputs, computed by the `reference` stage (or verify, on a miss), for verify
        and render (model.reference)."""
        return self.root / "reference"

    @property
    def reference_index(self) -> Path:
        """What the `reference` stage computed: its entries, by label."""
        return self.reference_cache / "index.json"

    @property
    def settings(self) -> Path:
        """The settings as doit resolved them, handed to each stage process whole."""
        return self.root / "settings.json"

    @property
    def meta_checkpoint(self) -> Path:
        """The profile's weights in Meta's format, written by `parity` for Meta's own loader."""
        return self.root / "parity" / "sam3.pt"

    @property
    def parity_json(self) -> Path:
        return self.root / "parity" / "parity.json"

    @property
    def parity_md(self) -> Path:
        return self.root / "parity" / "parity.md"

    @property
    def bench_json(self) -> Path:
        return self.root / "bench" / "bench.json"

    @property
    def bench_md(self) -> Path:
        return self.root / "bench" / "bench.md"

    @property
    def bench_plot(self) -> Path:
        return self.root / "bench" / "bench.png"

    @property
    def throughput_json(self) -> Path:
        return self.root / "throughput" / "throughput.json"

    @property
    def throughput_md(self) -> Path:
        return self.root / "throughput" / "throughput.md"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def inductor_cache(self) -> Path:
        """Inductor's and Triton's caches for this variant's stages (TORCHINDUCTOR_CACHE_DIR)."""
        return self.root / "inductor-cache"

    def log(self, stage: str) -> Path:
        return self.root / "logs" / f"{stage}.log"
