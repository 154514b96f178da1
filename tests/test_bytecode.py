"""A module whose sources have no bytecode where Python writes none (PYTHONDONTWRITEBYTECODE, as some GPU images
set) is compiled by every process that imports it: on an H100 machine so, torch took 3.2-3.6 s an import, 1.4-1.7 s
with its bytecode (benchmarks/h100-2026-12-07-bytecode/). The build and segment say so in one line, with the fix."""

import compileall
import sys

import pytest


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A package `installed_pkg` on sys.path, with sources and no bytecode."""
    package = tmp_path / "site" / "installed_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(package.parent))
    return package


def test_a_module_without_bytecode_where_none_is_written_is_named_with_the_fix(installed, monkeypatch):
    from sam3_aoti.runtime.files import bytecode_advice, without_bytecode

    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert without_bytecode("installed_pkg") == installed
    advice = bytecode_advice("installed_pkg")
    assert advice == (f"installed_pkg in {installed} has no bytecode and Python writes none here: every process "
                      f"compiles it as it imports it (seconds each); compile it once: python -m compileall -q -j 0 "
                      f"{installed.parent}")
    assert "installed_pkg" not in sys.modules  # found, not imported

    assert compileall.compile_dir(str(installed.parent), quiet=1)  # the fix the line gives
    assert without_bytecode("installed_pkg") is None and bytecode_advice("installed_pkg") is None


def test_no_advice_where_the_first_import_writes_the_bytecode_or_the_module_is_not_python(installed, monkeypatch):
    from sam3_aoti.runtime.files import without_bytecode

    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert without_bytecode("installed_pkg") is None  # its first import writes it
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert without_bytecode("no_such_module_here") is None
    assert without_bytecode("_json") is None  # an extension or built-in: nothing to compile


def test_segment_says_it_before_ray_starts(tmp_path, monkeypatch, capsys):
    pytest.importorskip("ray")
    import sam3_aoti.runtime.files as files
    from sam3_aoti.batch.engine import segment
    from sam3_aoti.errors import ConfigError

    monkeypatch.setattr(files, "without_bytecode", lambda module: tmp_path / "site" / module)
    with pytest.raises(ConfigError):  # stops before Ray starts
        segment(str(tmp_path), tmp_path / "out", ["a cat"], str(tmp_path / "none.pt2"), batch_size=0)
    assert (f"sam3-aoti segment: torch in {tmp_path / 'site' / 'torch'} has no bytecode and Python writes none "
            f"here") in capsys.readouterr().err
