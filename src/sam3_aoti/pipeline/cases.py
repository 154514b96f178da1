"""Verify/render cases: real photographs with prompts that name what is in them (cases.toml)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .paths import DEFAULT_CASES
from .schema import check_known, read_toml


@dataclass(frozen=True)
class Case:
    name: str
    image_ref: str
    prompts: tuple[str, ...]  # Meta's "visual" for a case of boxes alone
    boxes: tuple[tuple[float, float, float, float], ...] = ()  # exemplar boxes, pixels of the file (x0, y0, x1, y1)
    labels: tuple[int, ...] = ()  # 1 positive, 0 negative, one per box

    def exemplars(self, width: int, height: int):
        """The case's boxes as `encode_boxes` takes them: `[1, K, 4]` normalized, `[1, K]` labels."""
        from ..runtime.exemplars import normalized_boxes

        return normalized_boxes(list(self.boxes), list(self.labels), width, height)

    def load_image(self):
        """HxWx3 uint8 RGB (numpy), read as `predict` reads an image (runtime.images: as a viewer shows it)."""
        from ..errors import PackageError
        from ..runtime.images import array_to_rgb8, read_image

        if self.image_ref.startswith("skimage:"):
            import skimage.data

            return array_to_rgb8(getattr(skimage.data, self.image_ref.removeprefix("skimage:"))())
        try:
            return read_image(Path(self.image_ref))
        except PackageError as e:
            raise ConfigError(f"case {self.name}: {e}") from None


IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp"}
CASE_KEYS = {"case": ("image", "prompts", "boxes", "negative_boxes"), "folder": ("path", "prompts")}


def _tables(path: Path, table: dict, kind: str) -> list[dict]:
    """`[[case]]` / `[[folder]]`: an array of tables, each with only the keys it can have."""
    value = table.get(kind, [])
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{path}: `{kind}` must be [[{kind}]] tables (an array of tables), got {value!r}: "
                          f"write [[{kind}]] on a line of its own, then its keys")
    for i, entry in enumerate(value):
        for key in entry:
            check_known(path, f"[[{kind}]] {i + 1}", key, CASE_KEYS[kind])
    return value


def folder_entries(path: Path, folders: list[dict]) -> list[tuple[str, dict]]:
    """`[[folder]]` tables: every image in `path` becomes a case with the folder's prompts."""
    entries = []
    for i, folder in enumerate(folders):
        where = f"[[folder]] {i + 1}"
        if not isinstance(folder.get("path"), str) or not folder["path"]:
            raise ConfigError(f"{path} {where}: path must be a folder's path (a string), got {folder.get('path')!r}")
        root = (Path(path).parent / folder["path"]).resolve()
        if not root.is_dir():
            raise ConfigError(f"{path} {where}: image folder {root} does not exist: fix `path` in its [[folder]] table")
        images = sorted(p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not images:
            raise ConfigError(f"{path} {where}: image folder {root} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
        entries += [(f"{where} ({image.name})", {"image": str(image), "prompts": folder.get("prompts")})
                    for image in images]
    return entries


def case_entries(path: Path) -> list[tuple[str, dict]]:
    """(where, {image, prompts}) for every [[case]] and every image of every [[folder]], as written."""
    table = read_toml(path, "cases file", "fix it or restore cases.toml from the repository")
    for key in table:
        check_known(path, "the top level", key, tuple(CASE_KEYS))
    entries = [(f"[[case]] {i + 1}", entry) for i, entry in enumerate(_tables(path, table, "case"))]
    entries += folder_entries(path, _tables(path, table, "folder"))
    if not entries:
        raise ConfigError(f"{path} holds no [[case]] entries: add at least one image with prompts")
    return entries


def load_cases(path: Path = DEFAULT_CASES) -> list[Case]:
    from ..runtime.contract import NEGATIVE, POSITIVE, VISUAL_PROMPT

    check_cases(path)
    cases, names = [], set()
    for _, entry in case_entries(path):
        ref = entry["image"]
        if not ref.startswith("skimage:"):
            ref = str((Path(path).parent / ref).resolve())
        boxes = [tuple(b) for b in entry.get("boxes", [])] + [tuple(b) for b in entry.get("negative_boxes", [])]
        labels = [POSITIVE] * len(entry.get("boxes", [])) + [NEGATIVE] * len(entry.get("negative_boxes", []))
        name = base = Path(ref.removeprefix("skimage:")).stem + ("-exemplars" if boxes else "")
        while name in names:  # one image in two cases: render's pictures and verify's rows need distinct names
            name = f"{base}-{len(names)}"
        names.add(name)
        cases.append(Case(name, ref, tuple(entry.get("prompts") or [VISUAL_PROMPT]), tuple(boxes), tuple(labels)))
    return cases


def check_cases(path: Path) -> None:
    """cases.toml: every image exists, decodes and is of a size the package takes; every prompts entry is a
    non-empty list of non-empty strings."""
    from PIL import Image, UnidentifiedImageError

    from ..errors import PackageError
    from ..runtime.images import check_size

    for where, entry in case_entries(path):
        prompts = entry.get("prompts")
        has_boxes = bool(entry.get("boxes") or entry.get("negative_boxes"))
        if (prompts is not None or not has_boxes) and (
                not isinstance(prompts, list) or not prompts
                or not all(isinstance(p, str) and p.strip() for p in prompts)):
            raise ConfigError(f"{path} {where}: prompts must be a non-empty list of non-empty strings, "
                              f"got {prompts!r}: write prompts = [\"a cat\", \"a dog\"] (or leave it out beside boxes)")
        for key in ("boxes", "negative_boxes"):
            boxes = entry.get(key, [])
            if not isinstance(boxes, list) or not all(
                    isinstance(b, list) and len(b) == 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                                 for v in b) for b in boxes):
                raise ConfigError(f"{path} {where}: {key} must be a list of [x0, y0, x1, y1] boxes in pixels of the "
                                  f"image, got {boxes!r}")
        image = entry.get("image")
        if not isinstance(image, str) or not image:
            raise ConfigError(f"{path} {where}: needs image = \"skimage:NAME\" or a path to an image file, got {image!r}")
        if image.startswith("skimage:"):
            import skimage.data

            name = image.removeprefix("skimage:")
            if name not in skimage.data.__all__:
                raise ConfigError(f"{path} {where}: skimage has no sample image {name!r}: use one of "
                                  f"astronaut, chelsea, coffee, rocket, camera, coins, ...")
        if has_boxes:
            _check_boxes(path, where, entry, image)
        if image.startswith("skimage:"):
            continue
        file = (Path(path).parent / image).resolve()
        if not file.is_file():
            raise ConfigError(f"{path} {where}: image {file} does not exist: fix the path (relative to {path})")
        try:
            with Image.open(file) as picture:
                check_size(file, picture.width, picture.height)
                picture.verify()
        except PackageError as e:
            raise ConfigError(f"{path} {where}: {e}") from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise ConfigError(f"{path} {where}: image {file} does not decode ({e}): replace or remove it") from None


def _check_boxes(path: Path, where: str, entry: dict, image: str) -> None:
    """The case's boxes fit its image (`runtime.exemplars.check_corners`, as `predict` checks them), without
    torch: doit checks the cases when it loads."""
    from ..errors import InputError
    from ..runtime.exemplars import check_corners

    case = Case("check", image if image.startswith("skimage:") else str((Path(path).parent / image).resolve()), ())
    try:
        picture = case.load_image()
    except ConfigError:
        return  # the image's own check says why
    try:
        check_corners([tuple(b) for b in entry.get("boxes", []) + entry.get("negative_boxes", [])],
                      picture.shape[1], picture.shape[0])
    except InputError as e:
        raise ConfigError(f"{path} {where}: {e}") from None
