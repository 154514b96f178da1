"""Bad settings are one line at doit's load, before any stage runs: pipeline.toml, cases.toml, the variables,
Inductor options (checked by the compile worker too)."""

import pytest
from PIL import Image

from helpers import copy_repo, one_line_error, run_doit


@pytest.mark.parametrize("old, new, words", [
    ("shapes = [[1, 1], [2, 3], [3, 4]]", "shapes = [[0, 1]]", "[verify] shapes must be a list of [batch, prompts]"),
    ("shapes = [[1, 1], [2, 3], [3, 4]]", 'shapes = "big"', "got 'big'"),
    ("max_abs = 1e-5", 'max_abs = "abc"', "[verify.tolerances.fp32] max_abs must be a finite number >= 0"),
    ("max_abs = 1e-5", "max_abs = nan", "max_abs must be a finite number >= 0, got nan"),
    ("max_abs = 1e-5", "max_abs = inf", "max_abs must be a finite number >= 0, got inf"),
    ("max_abs = 1e-5", "max_abs = -1.0", "max_abs must be a finite number >= 0, got -1.0"),
    ("seed = 0", "seeed = 0", "[weights]: unknown key `seeed`: did you mean `seed`?"),
    ("bias_noise = 0.1", "bias_noise = 0.1\nmatrx_gain = 2.0", "unknown key `matrx_gain`: did you mean `matrix_gain`?"),
    ("[render]", "[rendr]", "at the top level: unknown key `rendr`: did you mean `render`?"),
    ("iters = 20", "iters = 100000000", "[bench] iters must be an integer from 1 to 100000"),
    ("max_instances = 5", "max_instances = 5\nthreshold = 0.5", "[render]: unknown key `threshold`"),
    ("shapes = [[1, 1], [2, 3], [4, 4], [16, 1], [1, 16]]", "shapes = [[0, 1]]", "[bench] shapes must be"),
    ('masked_attention = "sdpa"', 'masked_attention = "flash"', '[export] masked_attention must be "sdpa" or "eager"'),
    ('optimizations = ["box_bias_kernel"', 'optimizations = ["fast", "box_bias_kernel"',
     "[export] optimizations must be a list of distinct optimizations from 'box_bias_kernel', 'relu_epilogue'"),
    ('{ fp8 = ["vit_window_order", "vit_qkv_rope"] }', '{ fp16 = ["vit_window_order"] }',
     "[export] precision_optimizations must be a table of precision = value, each precision one of 'fp32'"),
    ('{ fp8 = ["vit_window_order", "vit_qkv_rope"] }', '{ fp8 = ["fast"] }',
     "each value a list of distinct optimizations from 'box_bias_kernel'"),
    ('sdpa_backends = ["cudnn", "flash", "efficient", "math"]', 'sdpa_backends = ["cudnn", "fast"]',
     "[compile] sdpa_backends must be a list of distinct SDPA kernels"),
    ('columns = ["meta", "transformers", "exported", "aoti", "aoti_graphs", "aoti_graphs_whole"]', 'columns = ["aoti", "triton"]',
     "[bench] columns must be a list of distinct columns"),
    ('inductor = { max_autotune_gemm = true, max_autotune_gemm_backends = "ATEN,TRITON" }', 'inductor = "max"',
     "[tune] inductor must be a table of torch._inductor.config keys"),
    ("top1_same_min = 0.8", "top1_same_min = 2", "[parity.tolerances.bf16] top1_same_min must be a finite number >= 0 and <= 1"),
    ("[profiles.tiny]", "[old.tiny]", "has no [profiles] table"),
    ("example_batch = 2", "example_batch = 1", "example_batch must be an integer from 2 to 64"),
    ("[verify.tolerances.bf16.per_output.pred_boxes]", "[verify.tolerances.bf16.per_output.boxes]",
     "[verify.tolerances.bf16.per_output]: unknown key `boxes`: did you mean `pred_boxes`?"),
    ("max_abs = 1e-3  # boxes", 'max_abs = "1px"  # boxes', "[verify.tolerances.bf16.per_output.pred_boxes] max_abs must be a finite number"),
    ("broken = 4", "broken = 4\nactors = [1, 1]", "[throughput] actors must be a list of distinct model actor counts"),
])
def test_a_bad_pipeline_toml_is_one_line_at_load(tmp_path, old, new, words):
    repo = copy_repo(tmp_path)
    config = repo / "pipeline.toml"
    assert old in config.read_text()
    text = config.read_text().replace(old, new, 1)
    if old == "[profiles.tiny]":  # no profiles at all: both tables out (commented)
        text = text.replace("[old.tiny]", "# [old.tiny]").replace("[profiles.sam3]", "# [old.sam3]")
        text = "\n".join(f"# {line}" if line.startswith(("architecture", "precision")) else line for line in text.split("\n"))
    config.write_text(text)
    proc = run_doit(repo, "list", check=False)
    one_line_error(proc, words)
    assert "pipeline.toml" in proc.stderr and proc.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.replace('prompts = ["a cat"]', 'prompts = "a cat"'), "prompts must be a non-empty list of non-empty strings"),
    (lambda t: t.replace('prompts = ["a cat"]', 'prompts = ["a cat", " "]'), "prompts must be a non-empty list"),
    (lambda t: t + '\n[[case]]\nimage = "missing.png"\nprompts = ["a roof"]\n', "does not exist"),
    (lambda t: t + '\n[[case]]\nimage = "broken.png"\nprompts = ["a roof"]\n', "does not decode"),
    (lambda t: t.replace("skimage:coins", "skimage:no_such_photo"), "skimage has no sample image"),
    (lambda t: 'case = "oops"\n', "`case` must be [[case]] tables"),
    (lambda t: t + '\n[[folder]]\npath = 5\nprompts = ["a roof"]\n', "path must be a folder's path (a string), got 5"),
    (lambda t: t.replace('prompts = ["a cat"]', 'prompts = ["a cat"]\nprompt = "a dog"', 1), "unknown key `prompt`: did you mean `prompts`?"),
    (lambda t: t + '\n[[case]]\nimage = "tiny.png"\nprompts = ["a dot"]\n', "is 1 x 1 pixels: the package takes images of at least 2 x 2"),
    (lambda t: t + '\n[[case]]\nimage = "skimage:coins"\nboxes = [[0, 0, 500, 40]]\n', "box 0,0,500,40 is outside the 384 x 303 image"),
    (lambda t: t + '\n[[case]]\nimage = "skimage:coins"\nnegative_boxes = [[30, 20, 10, 68]]\n', "has its corners reversed"),
    (lambda t: t + '\n[[case]]\nimage = "skimage:coins"\nboxes = [[nan, 0, 10, 10]]\n', "box nan,0,10,10 holds a coordinate that is not a finite number"),
    (lambda t: t + '\n[[case]]\nimage = "skimage:coins"\nboxes = [[1, 2, 3]]\n', "boxes must be a list of [x0, y0, x1, y1] boxes"),
    (lambda t: t + '\n[[case]]\nimage = "skimage:coins"\n', "prompts must be a non-empty list of non-empty strings, got None"),
])
def test_a_bad_cases_toml_is_one_line_at_load(tmp_path, edit, words):
    repo = copy_repo(tmp_path)
    (repo / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really")
    Image.new("RGB", (1, 1)).save(repo / "tiny.png")
    cases = repo / "cases.toml"
    cases.write_text(edit(cases.read_text()))
    proc = run_doit(repo, "list", check=False)
    one_line_error(proc, words)
    assert "cases.toml" in proc.stderr


@pytest.mark.parametrize("target, make, words", [
    ("cases.toml", lambda p: p.write_bytes(b"[[case]]\nimage = \"\xff\xfe\"\n"), "is not UTF-8 text"),
    ("cases.toml", lambda p: (p.unlink(), p.mkdir()), "is a folder, not a file"),
    ("pipeline.toml", lambda p: p.write_bytes(b"\xff\xfe[weights]\n"), "is not UTF-8 text"),
])
def test_config_files_that_are_folders_or_not_text_are_one_line(tmp_path, target, make, words):
    repo = copy_repo(tmp_path)
    make(repo / target)
    one_line_error(run_doit(repo, "list", check=False), words)


def test_config_a_folder_is_one_line(tmp_path):
    one_line_error(run_doit(copy_repo(tmp_path), "list", f"config={tmp_path}", check=False), "is a folder, not a file")


@pytest.mark.parametrize("args, words", [
    (["ref=a/b", "cache=/tmp/x"], "ref 'a/b': use up to 128 letters"),
    (["ref=" + "r" * 300, "cache=/tmp/x"], "(300 characters)"),
    (["ref=release-1"], "ref=release-1 names a package published to a binary cache, and no cache is set"),
])
def test_a_bad_ref_is_refused_when_doit_loads(tmp_path, args, words):
    one_line_error(run_doit(copy_repo(tmp_path), "list", *args, check=False), words)


def test_a_misspelt_variable_is_refused(tmp_path):
    proc = run_doit(copy_repo(tmp_path), "list", "profiel=sam3", check=False)
    one_line_error(proc, "unknown variable profiel=sam3 (did you mean profile?): use profile, device, precision")
    assert proc.returncode == 2  # bad input, as everywhere (errors.py)


def test_a_misspelt_inductor_option_is_refused_before_the_compile(tmp_path):
    from sam3_aoti.aoti.compile import check_inductor_options
    from sam3_aoti.errors import ConfigError

    check_inductor_options({"max_autotune_gemm": True, "aot_inductor.package": True}, "[compile] inductor")
    with pytest.raises(ConfigError, match="`max_autotune_gem` is no torch._inductor.config option .* did you mean "
                                          "`max_autotune_gemm`"):
        check_inductor_options({"max_autotune_gem": True}, "[compile] inductor")


@pytest.mark.slow  # a compile worker process
def test_a_compile_worker_refuses_a_misspelt_option_before_it_reads_its_program(tmp_path):
    """The compile stage starts its workers before it imports torch: each checks the options first, and the
    refusal crosses back to the stage whole (one line, exit 2)."""
    import pickle
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from sam3_aoti.aoti.compile import compile_program
    from sam3_aoti.errors import ConfigError

    missing = tmp_path / "no-such-archive.pt2"  # read after the check: reading it would fail otherwise
    with ProcessPoolExecutor(1, get_context("spawn")) as pool:
        job = pool.submit(compile_program, str(missing), "model", {"max_autotune_gem": True}, None,
                          str(tmp_path / "out"))
        with pytest.raises(ConfigError, match="did you mean `max_autotune_gemm`") as refused:
            job.result()
    assert refused.value.exit_code == 2 and not (tmp_path / "out").exists()
    assert str(pickle.loads(pickle.dumps(refused.value))) == str(refused.value)
