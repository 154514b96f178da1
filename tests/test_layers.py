"""The layout is a contract: import-linter checks the layers of pyproject.toml, and doit's code dependencies of each
stage are exactly its import closure, subpackages included."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=repo, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo / "src")})


def test_the_layering_contract_holds():
    proc = lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"Contracts: \d+ kept, 0 broken", proc.stdout), proc.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("runtime/files.py", "from ..pipeline import paths", "stages on the build's layers"),
    ("runtime/loader.py", "import transformers", "needs none of the build's dependencies"),
    ("runtime/loader.py", "import pyarrow", "needs none of the build's dependencies, the cache's"),
    ("runtime/info.py", "from ..cache import store", "needs none of the build's dependencies, the cache's"),
    ("cache/store.py", "from ..batch import engine", "the binary cache (the cache extra) needs neither"),
    ("cache/signing.py", "import ray", "the binary cache (the cache extra) needs neither"),
    ("batch/engine.py", "from .. import cli", "the command on everything"),
    ("stages/render.py", "from . import verify", "nothing imports a stage"),
    ("pipeline/paths.py", "from . import settings", "no import loops"),
])
def test_a_wrong_import_breaks_the_contract(tmp_path, module, line, contract):
    """Each contract can fail: one import against it, in a copy of the checkout, is reported."""
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(REPO / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "src" / "sam3_aoti" / module
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {line}\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0
    verdict = re.search(re.escape(contract) + r".*?\b(KEPT|BROKEN)\b", " ".join(proc.stdout.split()))  # names wrap
    assert verdict and verdict.group(1) == "BROKEN", proc.stdout


def stage_modules() -> list[str]:
    return sorted(p.stem for p in (REPO / "src" / "sam3_aoti" / "stages").glob("*.py") if p.stem != "__init__")


def test_each_stage_depends_on_exactly_the_modules_it_imports():
    """tasks.sources (read by doit for file_dep) against grimp, import-linter's own import graph, which sees
    function-level imports too. A stage that runs a module by name (`python -m`) depends on it as well."""
    import grimp

    import tasks

    graph = grimp.build_graph("sam3_aoti")
    runs = {s: {"sam3_aoti.toolchain.probe"} for s in ("toolchain", "probe")}  # compiler_fixes runs the probe
    src = REPO / "src"
    for stage in stage_modules():
        start = f"sam3_aoti.stages.{stage}"
        modules = {start} | graph.find_upstream_modules(start)
        for run in runs.get(stage, set()):  # a module run by name, with what it imports
            modules |= {run} | graph.find_upstream_modules(run)
        modules |= {".".join(m.split(".")[:i]) for m in set(modules) for i in range(1, m.count(".") + 1)}
        expected = {str(tasks.module_file(m)) for m in modules}
        got = set(tasks.sources(stage))
        assert got == expected, (stage, sorted(Path(p).relative_to(src).as_posix() for p in got ^ expected))


@pytest.mark.parametrize("folder", ["scripts", "tasks"])
def test_scripts_and_the_doit_side_import_the_library_never_a_stage(folder):
    """A stage runs as a process of its own (`python -m sam3_aoti.stages.NAME`); what a script or the doit side
    needs of one lives in a layer below (measure, model, pipeline)."""
    import ast

    found = []
    for path in sorted((REPO / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names if n.startswith("sam3_aoti.stages")]
    assert not found, found


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's tree is the layout: every subpackage and module of src/sam3_aoti is named in it,
    and docs/stages.md's table names every stage."""
    tree = (REPO / "docs" / "architecture.md").read_text().split("```")[1]
    package = REPO / "src" / "sam3_aoti"
    missing = [str(p.relative_to(package)) for p in sorted(package.rglob("*.py"))
               if p.name != "__init__.py" and p.parent.name != "stages" and p.name not in tree]
    missing += [f"{d.name}/" for d in package.iterdir() if d.is_dir() and (d / "__init__.py").exists()
                and f"{d.name}/" not in tree]
    assert not missing, f"docs/architecture.md's tree does not name {missing}"
    stages = {p.stem for p in (package / "stages").glob("*.py") if p.stem != "__init__"}
    table = (REPO / "docs" / "stages.md").read_text()
    assert all(f"| `{stage}` |" in table for stage in stages)  # the stages table names each stage module


def test_importing_the_runtime_loads_nothing_of_the_build():
    """In the checkout's environment, where transformers and doit are installed: the runtime and the public API
    import none of them, nor the `batch` extra (Ray, pyarrow, pycocotools: only a `segment` run imports them),
    and none of the build's layers (import-linter proves it for every runtime module, the torch-importing ones
    too; this runs the torch-free ones, quickly)."""
    probe = ("import sys, sam3_aoti.runtime, sam3_aoti.runtime.loader, sam3_aoti.cli, sam3_aoti.runtime.info, "
             "sam3_aoti.runtime.images, sam3_aoti.batch; from sam3_aoti import load_package, "
             "encode_prompts, archive_info; print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('transformers', 'doit', 'skimage', 'huggingface_hub', 'safetensors', 'ray', 'pyarrow', 'pycocotools') "
             "or m.split('.')[:2] in "
             "[['sam3_aoti', n] for n in ('pipeline', 'model', 'aoti', 'toolchain', 'stages')]))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
