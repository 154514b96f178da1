"""The one image reader (`predict`, verify's and render's cases): a file, or an array, to HxWx3 uint8 RGB as an
image viewer shows it, with its size limits stated in pixels of the file and one-line errors.

As a viewer shows it: the EXIF orientation applied (a phone's portrait photograph stands upright); 16- and
32-bit greys scaled from their range to 8 bits (PIL's own convert clips them, turning a 16-bit scan almost
entirely white); floats in [0, 1] scaled to [0, 255]; palettes, CMYK, YCbCr and LAB converted; transparency
composited over white, as a browser shows it on a white page; the first frame of a multi-page file.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import PackageError, first_line

MAX_PIXELS = 100_000_000  # about 10,000 x 10,000: larger rasters are tiled by the caller
MIN_SIDE = 2  # the transforms resize from at least 2 x 2 pixels
WIDE_GREYS = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def _grey_to_rgb8(grey, top: float):
    import numpy as np

    level = np.clip(grey.astype(np.float64) / max(top, 1e-12) * 255.0 + 0.5, 0, 255).astype(np.uint8)
    return np.repeat(level[..., None], 3, axis=-1)


def to_rgb8(image):
    """HxWx3 uint8 RGB from a PIL image of any mode, oriented as its EXIF says."""
    import numpy as np

    shown = as_shown(image)
    return shown if isinstance(shown, np.ndarray) else np.array(shown)


def as_shown(image):
    """A PIL image of any mode as a viewer shows it: an RGB PIL image oriented as its EXIF says (`image` itself
    where nothing changes: a 4000 px photograph is not copied twice on its way to bytes), or, for 16- and 32-bit
    greys, the HxWx3 uint8 array."""
    import numpy as np
    from PIL import ExifTags, Image, ImageOps

    if image.getexif().get(ExifTags.Base.Orientation, 1) != 1:
        image = ImageOps.exif_transpose(image)
    if image.mode in WIDE_GREYS:
        grey = np.asarray(image, dtype=np.float64)
        if image.mode.startswith("I;16") or (image.mode == "I" and grey.max() <= 65535):
            top = 65535.0
        elif image.mode == "F" and grey.max() <= 1.0:
            top = 1.0
        else:
            top = float(grey.max())
        return _grey_to_rgb8(grey, top)
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, rgba)
    return image if image.mode == "RGB" else image.convert("RGB")


def rgb8_bytes(image) -> tuple[bytes, tuple[int, int]]:
    """`to_rgb8(image)`'s bytes (HxWx3, row-major) and (H, W), without the array: one pass from PIL's memory."""
    import numpy as np

    shown = as_shown(image)
    if isinstance(shown, np.ndarray):
        return shown.tobytes(), shown.shape[:2]
    return shown.tobytes(), (shown.height, shown.width)


def array_to_rgb8(array):
    """HxWx3 uint8 RGB from an array image (a decoded file, skimage's samples): grey, RGB or RGBA; uint8,
    uint16 (scaled from 65535), or floats in [0, 1]."""
    import numpy as np

    array = np.asarray(array)
    if array.dtype == np.uint16:
        array = (array.astype(np.float64) / 65535.0 * 255.0 + 0.5).astype(np.uint8)
    elif np.issubdtype(array.dtype, np.floating):
        array = (np.clip(array, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    elif array.dtype == bool:
        array = array.astype(np.uint8) * 255
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=-1)
    if array.ndim == 3 and array.shape[-1] == 4:
        alpha = array[..., 3:].astype(np.float64) / 255.0
        array = (array[..., :3] * alpha + 255.0 * (1.0 - alpha) + 0.5).astype(np.uint8)
    return np.ascontiguousarray(array[..., :3]).astype(np.uint8)


def check_size(where, width: int, height: int) -> None:
    pixels = width * height
    if pixels > MAX_PIXELS:
        raise PackageError(f"{where} is {width} x {height} pixels ({pixels / 1e6:.0f} MP), over the "
                           f"{MAX_PIXELS / 1e6:.0f} MP limit: tile it and predict each tile")
    if min(width, height) < MIN_SIDE:
        raise PackageError(f"{where} is {width} x {height} pixels: the package takes images of at least "
                           f"{MIN_SIDE} x {MIN_SIDE} pixels")


def read_image(path: Path):
    """HxWx3 uint8 RGB as a viewer shows the file, or a one-line PackageError naming the file."""
    path = Path(path)
    try:
        return decode_image(path, path)
    except FileNotFoundError:
        raise PackageError(f"no image at {path}: pass an existing PNG/JPEG/TIFF file") from None
    except IsADirectoryError:
        raise PackageError(f"{path} is a folder, not an image: pass a PNG/JPEG/TIFF file") from None


def decode_image(source, where, as_bytes: bool = False):
    """`read_image` of a path or an open binary file (bytes read from a bucket: `io.BytesIO`); `where` names it in
    the one-line error. `as_bytes`: `rgb8_bytes`'s (bytes, (H, W)) instead of the array."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(source) as image:
            check_size(where, image.width, image.height)
            return rgb8_bytes(image) if as_bytes else to_rgb8(image)
    except (FileNotFoundError, IsADirectoryError):
        raise
    except Image.DecompressionBombError:
        raise PackageError(f"{where} is over the {MAX_PIXELS / 1e6:.0f} MP limit: tile it and predict each tile") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise PackageError(f"cannot read {where} as an image ({first_line(e)}): pass a PNG/JPEG/TIFF file") from None
