"""sam3-aoti: SAM3 text grounding as a verified AOTInductor package, and the runtime that loads it.

    from sam3_aoti import load_package
    package = load_package("sam3.pt2")
    outputs = package.model(package.transforms(images), package.encode_prompts(["a roof"]))

The names below are the runtime's public API (`sam3_aoti.runtime`, torch and a few small packages only); they
are imported on first use, so the build side (`sam3_aoti.pipeline`, read by doit) never pays for torch.
"""

from importlib import metadata

try:
    __version__ = metadata.version("sam3-aoti")
except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
    __version__ = "0+unknown"

# name -> the module that defines it, relative to this package (imported on first use, not by the stages)
_PUBLIC = {
    "load_package": ".runtime.loader", "Sam3Package": ".runtime.loader",
    "encode_prompts": ".runtime.tokenizer", "ClipTokenizer": ".runtime.tokenizer",
    "archive_info": ".runtime.info", "instances": ".runtime.postprocess", "read_image": ".runtime.images",
    "Sam3AotiError": ".errors", "PackageError": ".errors", "InputError": ".errors",
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    raise AttributeError(f"module 'sam3_aoti' has no attribute {name!r}")
