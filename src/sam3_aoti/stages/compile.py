"""Stage `compile`: AOTInductor-compile the exported `model` and `transforms` into code that holds no weights,
each in a process of its own (`aoti.workers`); the parts are `compile_parts`'s, beside it.

The compiled files depend on the program digest (graphs, signatures, weight layouts), never on the
weights' values: every tensor stays a constant of the model (none is inlined into a kernel) and the
constants live in a separate blob, which the `package` stage rebuilds from whatever weights the exported
programs hold. A new seed or checkpoint of the same architecture so re-packages in seconds, without
running AOTInductor again.
"""

from __future__ import annotations

from ..aoti.workers import compile_archive
from ..pipeline.paths import ToolchainPaths
from ..pipeline.settings import Settings
from ..toolchain.cuda_env import compiler_setup


def run(settings: Settings) -> None:
    compile_archive(settings, "compile", compiler_setup(ToolchainPaths.of(settings).env_file))


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("compile", run, __doc__.splitlines()[0])
