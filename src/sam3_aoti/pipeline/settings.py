"""Pipeline settings: the doit variables plus `pipeline.toml`, resolved and checked once, on the doit side,
and handed to each stage process whole as a JSON file (`Settings.write` / `Settings.read`). Imports no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path


from ..errors import ConfigError
from ..runtime.contract import FP8_CAPABILITY, FP8_NEEDS
from ..runtime.files import write_text_atomic
from .paths import DEFAULT_CONFIG, REPO_ROOT, portable, resolve_portable
from .precision import PRECISIONS, Precision
from .schema import OPTIMIZATIONS

PROFILES = ("tiny", "sam3")
DEVICES = ("cpu", "cuda")
TOOLKITS = ("pinned", "machine")  # the CUDA toolkit AOTInductor builds with (toolchain.cuda_toolkit)
SETTINGS_FORMAT = "sam3-aoti-settings/1"
HUB_MODEL = "facebook/sam3"


def gpu_present() -> bool:
    """A cheap look for an NVIDIA driver, without importing torch."""
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


@dataclass(frozen=True)
class Settings:
    profile: str
    device: str
    precision: str
    weights: str  # "random" or a checkpoint path
    config_path: Path
    artifacts_root: Path
    tables: dict = field(repr=False, compare=False)
    notice: str | None = field(default=None, compare=False)  # a one-line remark for the user (a fallback taken)
    toolkit: str = "pinned"

    @property
    def spec(self) -> Precision:
        """What this build's precision means (pipeline.precision)."""
        return PRECISIONS[self.precision]

    def write(self, path: Path) -> None:
        """The resolved settings as one JSON file, what a stage process reads (`read`)."""
        body = {"format": SETTINGS_FORMAT, "profile": self.profile, "device": self.device,
                "precision": self.precision, "weights": portable(self.weights),
                "config_path": portable(str(self.config_path)), "artifacts_root": portable(str(self.artifacts_root)),
                "toolkit": self.toolkit, "tables": self.tables}
        text = json.dumps(body, indent=2, sort_keys=True) + "\n"
        if not (path.is_file() and path.read_text() == text):
            write_text_atomic(path, text)

    @classmethod
    def read(cls, path: Path) -> "Settings":
        """Settings doit resolved and checked: nothing is re-resolved (a fallback taken stays taken)."""
        try:
            body = json.loads(Path(path).read_text())
            if body.get("format") != SETTINGS_FORMAT:
                raise ValueError(f"format {body.get('format')!r}")
            return cls(body["profile"], body["device"], body["precision"], resolve_portable(body["weights"]),
                       Path(resolve_portable(body["config_path"])), Path(resolve_portable(body["artifacts_root"])),
                       body["tables"], toolkit=body["toolkit"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"settings file {path} is unreadable ({e}): run the stage through `uv run doit`, "
                              "or pass --profile/--device/... instead of --settings") from None

    def stage(self, name: str) -> dict:
        """The stage's own table from pipeline.toml (empty if absent)."""
        return self.tables.get(name, {})

    @property
    def variant(self) -> str:
        """The build's folder name under artifacts/: variants of precision or device never share one."""
        return f"{self.profile}-{self.precision}-{self.device}"

    @property
    def split(self) -> bool:
        """Whether the package holds the model in parts too (`[export] split` names the profile)."""
        return self.profile in self.stage("export").get("split", [])

    @property
    def optimizations(self) -> tuple[str, ...]:
        """What the export applies: `[export] optimizations` and what `precision_optimizations` adds at this
        build's precision, in the registry's order."""
        export = self.stage("export")
        named = {*export.get("optimizations", ()), *export.get("precision_optimizations", {}).get(self.precision, ())}
        return tuple(name for name in OPTIMIZATIONS if name in named)

    @property
    def tuned(self) -> bool:
        """Whether `compile` uses Inductor's autotuning (the `tune` stage's results): on a GPU, when enabled."""
        return self.device == "cuda" and bool(self.stage("tune").get("enabled", False))

    @property
    def architecture(self) -> str:
        return self.tables["profiles"][self.profile]["architecture"]

    def fingerprint(self, stage: str, *extra_tables: str) -> dict:
        """What a stage's output depends on besides its files: its options, the platform, the versions."""
        return {
            "stage": stage,
            "profile": self.profile,
            "device": self.device,
            "precision": self.precision,
            "profile_table": self.tables["profiles"][self.profile],  # its architecture decides every stage
            "options": {name: self.stage(name) for name in (stage, *extra_tables)},
            "torch": package_version("torch"),
            "transformers": package_version("transformers"),
        }


def gpu_model() -> str | None:
    """The first NVIDIA GPU's model name, without importing torch (the driver's /proc files, else nvidia-smi)."""
    import subprocess

    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                return line.split(":", 1)[1].strip()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def gpu_capability() -> tuple[str, tuple[int, ...]] | None:
    """The first visible NVIDIA GPU's model and compute capability, without importing torch (nvidia-smi); None
    where nvidia-smi is absent or says nothing (the toolchain stage then names what is missing)."""
    import subprocess

    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(["nvidia-smi", "-i", first, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        name, capability = out.stdout.strip().splitlines()[0].rsplit(",", 1)
        return name.strip(), tuple(int(part) for part in capability.strip().split("."))
    except (OSError, subprocess.TimeoutExpired, IndexError, ValueError):
        return None


def cached_hub_checkpoint(repo_id: str = HUB_MODEL) -> Path | None:
    """The snapshot folder of `repo_id` in the local Hugging Face cache (HF_HUB_CACHE / HF_HOME rules),
    if it holds config.json and model.safetensors. Never touches the network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    cache_dir = os.environ.get("HF_HUB_CACHE")  # read now: huggingface_hub reads it once, at import
    found = [try_to_load_from_cache(repo_id, name, cache_dir=cache_dir) for name in ("config.json", "model.safetensors")]
    if all(isinstance(f, str) for f in found):
        return Path(found[0]).parent
    return None


def load_settings(
    profile: str | None = None,
    device: str | None = None,
    precision: str | None = None,
    weights: str | None = None,
    config: str | os.PathLike | None = None,
    artifacts: str | os.PathLike | None = None,
    toolkit: str | None = None,
) -> Settings:
    from .schema import check_pipeline, check_tolerances_for, read_toml

    config_path = Path(config) if config else DEFAULT_CONFIG
    tables = read_toml(config_path, "config file", "pass config=PATH to a pipeline.toml, or restore the repository's")
    check_pipeline(config_path, tables, PROFILES, tuple(PRECISIONS))
    profile = profile or "tiny"
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile={profile!r}: use one of {', '.join(PROFILES)}")
    notice = None
    if profile == "sam3" and not weights:
        weights = str(cached_hub_checkpoint() or "")
        if not weights:
            profile = "tiny"
            notice = (f"no SAM3 weights given and {HUB_MODEL} is not in the Hugging Face cache: building profile=tiny; "
                      "pass weights=PATH (HF folder or Meta's sam3.pt) or weights=random for the full model")
    device = device or ("cuda" if gpu_present() else "cpu")
    if device not in DEVICES:
        raise ConfigError(f"unknown device={device!r}: use cpu or cuda")
    if device == "cuda" and not gpu_present():
        raise ConfigError("device=cuda but no NVIDIA driver is loaded on this machine: use device=cpu")
    precision = precision or tables["profiles"][profile].get("precision", "fp32")
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision={precision!r}: use {', '.join(PRECISIONS)}")
    if PRECISIONS[precision].needs_cuda and device == "cpu":
        raise ConfigError(f"precision={precision} needs device=cuda: use precision=fp32 on the CPU")
    if precision == "fp8" and (gpu := gpu_capability()) and gpu[1] < FP8_CAPABILITY:
        raise ConfigError(f"precision=fp8 needs a GPU with fp8 tensor cores ({FP8_NEEDS}); {gpu[0]} has "
                          f"{'.'.join(map(str, gpu[1]))}: use precision=bf16")
    check_tolerances_for(config_path, tables, precision)
    weights = weights or "random"
    if profile == "tiny" and weights != "random":
        raise ConfigError("profile=tiny is always random-init: pass weights= only with profile=sam3")
    if weights != "random" and not Path(weights).exists():
        raise ConfigError(f"weights={weights} does not exist: pass weights=random or a checkpoint path")
    toolkit = toolkit or "pinned"
    if toolkit not in TOOLKITS:
        raise ConfigError(f"unknown toolkit={toolkit!r}: use pinned (the pip wheels uv.lock pins) or machine")
    root = Path(artifacts) if artifacts else REPO_ROOT / "artifacts"
    return Settings(profile, device, precision, weights, config_path, root, tables, notice, toolkit)


def compared_shapes(settings: Settings) -> dict:
    """What of `[verify]` decides verify's inputs, and so the `reference` stage's outputs (not its tolerances)."""
    opts = settings.stage("verify")
    return {key: opts.get(key) for key in ("shapes", "largest_shape")}
