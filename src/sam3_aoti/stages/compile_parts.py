"""Stage `compile_parts`: AOTInductor-compile the model's parts (`export_parts`) as `compile` does model's,
beside it: code without weights, keyed by the parts' program digest; the parts read model's weights."""

from __future__ import annotations

from ..aoti.workers import compile_archive
from ..pipeline.paths import ProfilePaths, ToolchainPaths
from ..pipeline.settings import Settings
from ..runtime.archive import PART_NAMES
from ..toolchain.cuda_env import compiler_setup


def run(settings: Settings) -> None:
    paths = ProfilePaths.of(settings)
    compile_archive(settings, "compile_parts", paths.exported_parts, PART_NAMES, paths.parts_digest, paths.compiled_parts,
                    compiler_setup(ToolchainPaths.of(settings).env_file))


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("compile_parts", run, __doc__.splitlines()[0])
