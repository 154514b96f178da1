"""Typed errors: each becomes one line at the task boundary, never a traceback."""


class Sam3AotiError(Exception):
    """Base: the message says what is wrong and how to fix it."""


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
