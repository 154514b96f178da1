"""Typed errors: each becomes one line at the task boundary, never a traceback.

Exit codes, everywhere (`sam3-aoti`, `python -m sam3_aoti.stages.<stage>`, doit's stage processes): 2 when what
was given cannot be used (arguments, settings, a checkpoint, a package, an image: fix the input), 1 when the work
itself failed (export, compile, drift, the toolchain), 130 when interrupted.
"""


class Sam3AotiError(Exception):
    """Base: the message says what is wrong and how to fix it."""

    exit_code = 1


def first_line(e: BaseException) -> str:
    """`Type: first line of the message`: what a one-line error quotes of a library's exception."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


class ConfigError(Sam3AotiError):
    exit_code = 2


class WeightsError(Sam3AotiError):
    exit_code = 2


class ExportError(Sam3AotiError):
    pass


class CompileError(Sam3AotiError):
    pass


class PackageError(Sam3AotiError):
    exit_code = 2


class DriftError(Sam3AotiError):
    pass


class ToolchainError(Sam3AotiError):
    pass


class InputError(Sam3AotiError):
    """A tensor, prompt or image handed to the package that it cannot take."""

    exit_code = 2
