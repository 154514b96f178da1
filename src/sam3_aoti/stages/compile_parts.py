"""Stage `compile_parts`: AOTInductor-compile the model's parts (`export_parts`) as `compile` does model's,
beside it: code without weights, keyed by the parts' program digest; the parts read model's weights."""

from __future__ import annotations

from ..aoti.workers import compile_archive
from ..pipeline.paths import ToolchainPaths
from ..pipeline.settings import Settings
from ..toolchain.cuda_env import compiler_setup


def run(settings: Settings) -> None:
    compile_archive(settings, "compile_parts", compiler_setup(ToolchainPaths.of(settings).env_file))


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("compile_parts", run, __doc__.splitlines()[0])
