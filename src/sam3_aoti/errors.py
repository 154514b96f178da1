"""Typed errors: each becomes one line at the task boundary, never a traceback."""


class Sam3AotiError(Exception):
    """Base: the message says what is wrong and how to fix it."""


def first_line(e: BaseException) -> str:
    """`Type: first line of the message`: what a one-line error quotes of a library's exception."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


class ConfigError(Sam3AotiError):
    pass


class WeightsError(Sam3AotiError):
    pass


class ExportError(Sam3AotiError):
    pass


class CompileError(Sam3AotiError):
    pass


class PackageError(Sam3AotiError):
    pass


class DriftError(Sam3AotiError):
    pass


class ToolchainError(Sam3AotiError):
    pass


class InputError(Sam3AotiError):
    """A tensor, prompt or image handed to the package that it cannot take."""
