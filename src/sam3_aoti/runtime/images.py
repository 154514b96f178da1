"""The image reader of `predict`: any PIL mode to HxWx3 uint8 RGB, with a size limit and one-line errors."""

from __future__ import annotations

from pathlib import Path

from ..errors import PackageError, first_line

MAX_PIXELS = 100_000_000  # about 10,000 x 10,000: larger rasters are tiled by the caller


def to_rgb8(image):
    """HxWx3 uint8 RGB from any PIL mode: 16-bit and 32-bit greys are scaled to 8 bits (PIL's own convert
    clips them, turning a 16-bit scan almost entirely white), palettes and alpha are resolved."""
    import numpy as np

    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        grey = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") or (image.mode == "I" and grey.max() <= 65535) else grey.max()
        grey = np.clip(grey / max(top, 1e-12) * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=-1)
    return np.array(image.convert("RGB"))


def read_image(path: Path):
    """HxWx3 uint8 RGB, or a one-line error."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            pixels = image.width * image.height
            if pixels > MAX_PIXELS:
                raise PackageError(f"{path} is {image.width} x {image.height} ({pixels / 1e6:.0f} MP), over the "
                                   f"{MAX_PIXELS / 1e6:.0f} MP limit: tile it and predict each tile")
            return to_rgb8(image)
    except FileNotFoundError:
        raise PackageError(f"no image at {path}: pass --image an existing PNG/JPEG/TIFF file") from None
    except Image.DecompressionBombError:
        raise PackageError(f"{path} is over the {MAX_PIXELS / 1e6:.0f} MP limit: tile it and predict each tile") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise PackageError(f"cannot read {path} as an image ({first_line(e)}): pass a PNG/JPEG/TIFF file") from None
