"""The tuning cache (sam3_aoti.aoti.tuning, sam3_aoti.stages.tune): what is kept of an Inductor cache, how compile seeds its own with it, and
when results are refused. The tuning itself runs on a GPU (`doit tune`); these are the CPU-side rules."""

import dataclasses
import json

import pytest

from helpers import copy_repo, run_doit
from sam3_aoti.pipeline.settings import load_settings
from sam3_aoti.errors import CompileError, ConfigError
from sam3_aoti.pipeline.paths import ProfilePaths
from sam3_aoti.aoti.tuning import count_decisions, harvest, keep_kernels, read_tuning, seed, tuned_files, tuning_key, tuning_options


def fake_inductor_cache(root, timings: dict, configs: dict):
    """An Inductor cache as a tuned compile leaves it: GEMM timings, kernels, their best configs, a Triton cache."""
    (root / "cache").mkdir(parents=True)
    (root / "cache" / "systemhash").write_text(json.dumps({"system": {"device": "H"}, "cache": timings}))
    for name, config in configs.items():
        (root / name[:2]).mkdir(exist_ok=True)
        (root / name[:2] / f"{name}.py").write_text("# generated kernel\n")
        (root / name[:2] / f"{name}.best_config").write_text(json.dumps(config))
    (root / "triton" / "0" / "abc").mkdir(parents=True)
    (root / "triton" / "0" / "abc" / "kernel.cubin").write_bytes(b"\0")
    return root


# Inductor's PersistentCache file: GEMM timings {op: {layout: {precision: {choice: ms}}}} and, in the same table,
# pad-mm's decisions and timings, one value per key (the real file mixes both)
TIMINGS = {"mm": {"layout-a": {"highest": {"aten": 0.1, "triton_1": 0.08}}, "layout-b": {"highest": {"aten": 0.2}}},
           "pad-mm-key-1": True, "pad-mm-key-2": 0.031}


def test_only_the_tuning_decisions_are_kept(tmp_path):
    cache = fake_inductor_cache(tmp_path / "cache", TIMINGS, {"cab12": {"XBLOCK": 64}, "cdf34": {"XBLOCK": 128}})
    assert [str(p) for p in tuned_files(cache)] == ["ca/cab12.best_config", "cache/systemhash", "cd/cdf34.best_config"]
    assert count_decisions(cache) == {"gemm_layouts": 2, "padding_decisions": 2, "kernel_configs": 2}
    assert harvest(cache, tmp_path / "results") == 3
    assert not list((tmp_path / "results").rglob("*.py")) and not (tmp_path / "results" / "triton").exists()


def test_the_tunings_compiled_kernels_join_the_compile_cache_without_replacing_any(tmp_path):
    cache = fake_inductor_cache(tmp_path / "cache", TIMINGS, {"cab12": {"XBLOCK": 64}})
    (cache / "triton" / "0" / "def").mkdir()
    (cache / "triton" / "0" / "def" / "kernel.cubin").write_bytes(b"new")
    dest = tmp_path / "inductor-cache"
    (dest / "triton" / "0" / "def").mkdir(parents=True)
    (dest / "triton" / "0" / "def" / "kernel.cubin").write_bytes(b"mine")
    assert keep_kernels(cache, dest) == 1
    assert (dest / "triton" / "0" / "abc" / "kernel.cubin").read_bytes() == b"\0"
    assert (dest / "triton" / "0" / "def" / "kernel.cubin").read_bytes() == b"mine"
    assert not (dest / "cache").exists() and not list(dest.rglob("*.best_config"))  # decisions go by seed only
    assert keep_kernels(tmp_path / "no-such-cache", dest) == 0


def test_seeding_merges_gemm_timings_and_copies_kernel_configs(tmp_path):
    results = fake_inductor_cache(tmp_path / "tuned", TIMINGS, {"cab12": {"XBLOCK": 64}})
    own = {"mm": {"layout-a": {"highest": {"aten": 9.0}}}, "bmm": {"layout-c": {"highest": {"aten": 1.0}}}}
    cache = tmp_path / "compile-cache"
    (cache / "cache").mkdir(parents=True)
    (cache / "cache" / "systemhash").write_text(json.dumps({"system": {"device": "H"}, "cache": own}))
    assert seed(results, cache) == 2
    merged = json.loads((cache / "cache" / "systemhash").read_text())["cache"]
    assert merged["mm"]["layout-a"]["highest"] == {"aten": 0.1, "triton_1": 0.08}  # the tuned entry wins
    assert merged["bmm"] == own["bmm"] and "layout-b" in merged["mm"]  # nothing of either is lost
    assert json.loads((cache / "ca" / "cab12.best_config").read_text()) == {"XBLOCK": 64}
    assert merged["pad-mm-key-1"] is True and merged["pad-mm-key-2"] == 0.031
    assert count_decisions(cache) == {"gemm_layouts": 3, "padding_decisions": 2, "kernel_configs": 1}


def cuda_settings(tmp_path, **tune):
    """Settings as on a GPU machine (device=cuda cannot be asked for without one)."""
    settings = load_settings(device="cpu", artifacts=tmp_path)
    tables = {**settings.tables, "tune": {**settings.tables["tune"], **tune}}
    return dataclasses.replace(settings, device="cuda", tables=tables)


def test_tuning_is_on_for_gpu_builds_when_enabled(tmp_path):
    assert not load_settings(device="cpu", artifacts=tmp_path).tuned
    assert not cuda_settings(tmp_path).tuned  # off by default (pipeline.toml says why)
    assert cuda_settings(tmp_path, enabled=True).tuned
    options = tuning_options(cuda_settings(tmp_path, inductor={"max_autotune_gemm": True}))
    assert options["max_autotune_gemm"] is True


def test_results_for_another_gpu_or_graph_are_refused(tmp_path):
    settings = cuda_settings(tmp_path)
    paths = ProfilePaths.of(settings)
    platform = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0"}
    key = tuning_key(settings, "graph-1", platform)
    with pytest.raises(CompileError, match="run `uv run doit tune`"):
        read_tuning(paths, key)
    paths.tuning.mkdir(parents=True)
    paths.tuning_index.write_text(json.dumps({"key": key, "gemm_layouts": 1, "kernel_configs": 1}))
    assert read_tuning(paths, key)["gemm_layouts"] == 1
    for change in ({"gpu": "NVIDIA A100-SXM4-80GB"}, {"triton": "3.7.0"}):
        with pytest.raises(CompileError, match=f"for another {next(iter(change))}"):
            read_tuning(paths, tuning_key(settings, "graph-1", {**platform, **change}))
    with pytest.raises(CompileError, match="for another program_sha256"):
        read_tuning(paths, tuning_key(settings, "graph-2", platform))
    with pytest.raises(CompileError, match="for another inductor"):
        read_tuning(paths, tuning_key(cuda_settings(tmp_path, inductor={}), "graph-1", platform))


def test_tune_says_it_is_off_on_the_cpu(tmp_path):
    from sam3_aoti.stages.tune import run

    with pytest.raises(ConfigError, match=r"\[tune\] enabled"):
        run(load_settings(device="cpu", artifacts=tmp_path))
    proc = run_doit(copy_repo(tmp_path), "tune", "device=cpu")
    assert "tuning is off (device=cpu)" in proc.stdout


def test_the_tune_table_is_checked(tmp_path):
    config = tmp_path / "pipeline.toml"
    from sam3_aoti.pipeline.settings import DEFAULT_CONFIG

    text = DEFAULT_CONFIG.read_text()
    assert text.count("\nenabled = false\n") == 1
    config.write_text(text.replace("\nenabled = false\n", "\nenabled = 1\n"))
    with pytest.raises(ConfigError, match=r"\[tune\] enabled must be true or false"):
        load_settings(device="cpu", config=config)


AUTOTUNED_COMPILE = """
import sys, torch
from sam3_aoti.pipeline.vec_isa import skip_known_isa_check
skip_known_isa_check()  # as the tune and compile stages do: the ISA check once per machine
class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 128)
    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x))
torch.manual_seed(0)
x = torch.randn(32, 64)
program = torch.export.export(Layer(), (x,))
torch._inductor.aot_compile(program.module(), (x,), options={
    "aot_inductor.package": True, "max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,CPP"})
"""


@pytest.mark.slow
def test_a_real_autotuned_compile_is_harvested_and_its_results_spare_the_next_compile_any_benchmark(tmp_path):
    """Inductor's own files, not a fixture: max-autotune (CPU GEMM templates against ATen) in an empty cache,
    harvested; a compile in another empty cache seeded with the results benchmarks nothing new."""
    import os
    import subprocess
    import sys

    script = tmp_path / "compile.py"
    script.write_text(AUTOTUNED_COMPILE)

    def compile_in(cache):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stderr

    tuning_log = compile_in(tmp_path / "tune-cache")
    assert "AUTOTUNE addmm" in tuning_log
    tuned = count_decisions(tmp_path / "tune-cache")
    assert tuned["gemm_layouts"] == 1, tuned
    assert harvest(tmp_path / "tune-cache", tmp_path / "results") >= 1
    seed(tmp_path / "results", tmp_path / "compile-cache")
    assert count_decisions(tmp_path / "compile-cache") == tuned
    compile_log = compile_in(tmp_path / "compile-cache")
    assert "AUTOTUNE" not in compile_log and count_decisions(tmp_path / "compile-cache") == tuned
