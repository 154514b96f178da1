"""Pipeline settings: the doit variables plus `pipeline.toml`. Imports no torch (doit loads this)."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from .errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "pipeline.toml"
DEFAULT_CASES = REPO_ROOT / "cases.toml"
PROFILES = ("tiny", "sam3")
DEVICES = ("cpu", "cuda")
PRECISIONS = ("fp32", "bf16")


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

    def stage(self, name: str) -> dict:
        """The stage's own table from pipeline.toml (empty if absent)."""
        return self.tables.get(name, {})

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
            "options": {name: self.stage(name) for name in (stage, *extra_tables)},
            "torch": package_version("torch"),
            "transformers": package_version("transformers"),
        }


def load_settings(
    profile: str | None = None,
    device: str | None = None,
    precision: str | None = None,
    weights: str | None = None,
    config: str | os.PathLike | None = None,
    artifacts: str | os.PathLike | None = None,
) -> Settings:
    config_path = Path(config) if config else DEFAULT_CONFIG
    try:
        tables = tomllib.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {config_path} not found: pass config=PATH to an existing pipeline.toml") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {config_path} is not valid TOML ({e}): fix the file") from None

    profile = profile or "tiny"
    if profile not in PROFILES or profile not in tables.get("profiles", {}):
        raise ConfigError(f"unknown profile={profile!r}: use one of {', '.join(PROFILES)}")
    device = device or ("cuda" if gpu_present() else "cpu")
    if device not in DEVICES:
        raise ConfigError(f"unknown device={device!r}: use cpu or cuda")
    if device == "cuda" and not gpu_present():
        raise ConfigError("device=cuda but no NVIDIA driver is loaded on this machine: use device=cpu")
    precision = precision or tables["profiles"][profile].get("precision", "fp32")
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision={precision!r}: use fp32 or bf16")
    if precision == "bf16" and device == "cpu":
        raise ConfigError("precision=bf16 needs device=cuda: use precision=fp32 on the CPU")
    weights = weights or "random"
    if profile == "tiny" and weights != "random":
        raise ConfigError("profile=tiny is always random-init: pass weights= only with profile=sam3")
    if weights != "random" and not Path(weights).exists():
        raise ConfigError(f"weights={weights} does not exist: pass weights=random or a checkpoint path")
    root = Path(artifacts) if artifacts else REPO_ROOT / "artifacts"
    return Settings(profile, device, precision, weights, config_path, root, tables)
