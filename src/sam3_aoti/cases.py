"""Verify/render cases: real photographs with prompts that name what is in them (cases.toml)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from .config import DEFAULT_CASES
from .errors import ConfigError

@dataclass(frozen=True)
class Case:
    name: str
    image_ref: str
    prompts: tuple[str, ...]

    def load_image(self):
        """HxWx3 uint8 RGB (numpy)."""
        import numpy as np

        if self.image_ref.startswith("skimage:"):
            import skimage.data

            image = getattr(skimage.data, self.image_ref.removeprefix("skimage:"))()
        else:
            from PIL import Image

            try:
                image = np.asarray(Image.open(self.image_ref).convert("RGB"))
            except OSError as e:
                raise ConfigError(f"case image {self.image_ref} unreadable ({e}): fix the path in the cases file") from None
        if image.ndim == 2:
            image = np.stack([image] * 3, axis=-1)
        return np.ascontiguousarray(image[..., :3]).astype(np.uint8)


IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp"}


def folder_entries(path: Path, folders: list[dict]) -> list[tuple[str, dict]]:
    """`[[folder]]` tables: every image in `path` becomes a case with the folder's prompts."""
    entries = []
    for i, folder in enumerate(folders):
        root = (Path(path).parent / folder.get("path", "")).resolve()
        if not root.is_dir():
            raise ConfigError(f"{path}: image folder {root} does not exist: fix `path` in its [[folder]] table")
        images = sorted(p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not images:
            raise ConfigError(f"{path}: image folder {root} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
        entries += [(f"[[folder]] {i + 1} ({image.name})", {"image": str(image), "prompts": folder.get("prompts")})
                    for image in images]
    return entries


def case_entries(path: Path) -> list[tuple[str, dict]]:
    """(where, {image, prompts}) for every [[case]] and every image of every [[folder]], as written."""
    try:
        table = tomllib.loads(Path(path).read_text())
    except (FileNotFoundError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cases file {path} unreadable ({e}): fix it or restore cases.toml") from None
    entries = [(f"[[case]] {i + 1}", entry) for i, entry in enumerate(table.get("case", []))]
    entries += folder_entries(path, table.get("folder", []))
    if not entries:
        raise ConfigError(f"{path} holds no [[case]] entries: add at least one image with prompts")
    return entries


def load_cases(path: Path = DEFAULT_CASES) -> list[Case]:
    from .validate import check_cases

    check_cases(path)
    cases = []
    for _, entry in case_entries(path):
        ref = entry["image"]
        if not ref.startswith("skimage:"):
            ref = str((Path(path).parent / ref).resolve())
        cases.append(Case(Path(ref.removeprefix("skimage:")).stem, ref, tuple(entry["prompts"])))
    return cases
