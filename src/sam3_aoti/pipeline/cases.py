"""Verify/render cases: real photographs with prompts that name what is in them (cases.toml)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tomllib

from ..errors import ConfigError
from .paths import DEFAULT_CASES


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
    check_cases(path)
    cases = []
    for _, entry in case_entries(path):
        ref = entry["image"]
        if not ref.startswith("skimage:"):
            ref = str((Path(path).parent / ref).resolve())
        cases.append(Case(Path(ref.removeprefix("skimage:")).stem, ref, tuple(entry["prompts"])))
    return cases


def check_cases(path: Path) -> None:
    """cases.toml: every image exists and decodes, every prompts entry is a non-empty list of non-empty strings."""
    from PIL import Image, UnidentifiedImageError

    for where, entry in case_entries(path):
        prompts = entry.get("prompts")
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
            raise ConfigError(f"{path} {where}: prompts must be a non-empty list of non-empty strings, "
                              f"got {prompts!r}: write prompts = [\"a cat\", \"a dog\"]")
        image = entry.get("image")
        if not isinstance(image, str) or not image:
            raise ConfigError(f"{path} {where}: needs image = \"skimage:NAME\" or a path to an image file")
        if image.startswith("skimage:"):
            import skimage.data

            name = image.removeprefix("skimage:")
            if name not in skimage.data.__all__:
                raise ConfigError(f"{path} {where}: skimage has no sample image {name!r}: use one of "
                                  f"astronaut, chelsea, coffee, rocket, camera, coins, ...")
            continue
        file = (Path(path).parent / image).resolve()
        if not file.is_file():
            raise ConfigError(f"{path} {where}: image {file} does not exist: fix the path (relative to {path})")
        try:
            with Image.open(file) as picture:
                picture.verify()
        except (UnidentifiedImageError, OSError, SyntaxError) as e:
            raise ConfigError(f"{path} {where}: image {file} does not decode ({e}): replace or remove it") from None
