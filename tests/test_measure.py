"""Measurement as a library (`sam3_aoti.measure`): the FLOP count sees the project's ops, the weights a part
reads are counted once each, sections re-run alone on what a whole call gave them, timing's fairness
rules (rotated order, p90), and the comparison of two runtimes' load times."""

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sam3_aoti.measure.timing import p90, rotated
from sam3_aoti.model.configs import example_inputs
from sam3_aoti.model.grounding import Sam3Grounding


@pytest.fixture(scope="module")
def wrapper(tiny_model):
    return Sam3Grounding(copy.deepcopy(tiny_model)).eval()


def test_rows_rotate_the_columns_and_p90_is_the_ninetieth_percentile():
    assert [rotated(["a", "b", "c"], i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                                ["a", "b", "c"]]
    assert rotated([], 3) == []
    assert p90(list(range(11))) == 9 and p90([5.0]) == 5.0


def test_bench_counts_the_flops_inside_the_projects_ops():
    """The FLOP count (bench's, per part) (FlopCounterMode) see an op of the project as one call: each registers its count,
    attention as SDPA's (4 B H Lq Lk D) and the box-bias MLP as its two linear layers'."""
    from torch.utils.flop_counter import FlopCounterMode

    import sam3_aoti.runtime.box_bias as box_bias

    def counted(fn, *args) -> int:
        counter = FlopCounterMode(display=False)
        with counter:
            fn(*args)
        return counter.get_total_flops()

    q, k, v = torch.randn(2, 4, 40, 16), torch.randn(2, 4, 64, 16), torch.randn(2, 4, 64, 16)
    tables = torch.randn(2, 4, 40, 8), torch.randn(2, 4, 40, 8)
    assert counted(torch.ops.sam3_aoti.attention, q, k, v, 0.25, *tables) == 4 * 2 * 4 * 40 * 64 * 16
    mlp = torch.randn(2, 5, 7, 2), torch.randn(32, 2), torch.randn(32), torch.randn(4, 32), torch.randn(4)
    assert counted(torch.ops.sam3_aoti.box_bias_mlp, *mlp) == counted(box_bias.linear_layers, *mlp) > 0


def test_gemms_with_an_activation_in_their_epilogue_count_as_the_gemm():
    """`relu_epilogue`'s and `vit_gelu_epilogue`'s `aten._addmm_activation`, which torch's FlopCounterMode has no
    count for, counts as its addmm (the sections' and bench's FLOPs)."""
    from sam3_aoti.measure.counts import flops_of

    class Epilogue(torch.nn.Linear):
        def forward(self, x):
            return torch._addmm_activation(self.bias, x, self.weight.t(), use_gelu=self.use_gelu)

    x = torch.randn(30, 16)
    for use_gelu in (False, True):
        epilogue = Epilogue(16, 24)
        epilogue.use_gelu = use_gelu
        assert flops_of(epilogue, (x,)) == flops_of(torch.nn.Linear(16, 24), (x,)) == 2 * 30 * 16 * 24

def test_bench_counts_the_weights_a_part_reads_once_each(wrapper, tiny_model):
    """A part's weights read (bench's floor) counts each weight once: a call through two of three linears reads those two (a
    transpose or slice of a weight counts as the weight, a weight used twice once, an embedding table the rows
    looked up); a section reads what its modules hold (the ViT all of its weights), and together no more
    than the model holds."""
    from sam3_aoti.measure.counts import flops_and_weights_of
    from sam3_aoti.model.section_calls import SECTIONS, record_section_calls

    layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
    per_linear = (8 * 8 + 8) * 4
    x = torch.randn(2, 8)
    through_two = lambda: layers[1](layers[0](x)) + (x @ layers[0].weight.t()[:, :4]).sum()  # noqa: E731
    _, read = flops_and_weights_of(layers, (), through_two)
    assert read == 2 * per_linear
    table = torch.nn.Embedding(100, 8)
    _, read = flops_and_weights_of(table, (torch.tensor([[3, 5, 3], [7, 0, 0]]),))
    assert read == 4 * 8 * 4  # the four distinct rows looked up, not the table
    images, token_ids = example_inputs(tiny_model.config, 1, 2, seed=7)
    sections = record_section_calls(wrapper, images, token_ids)
    reads = {name: flops_and_weights_of(wrapper, (), sections[name].run)[1] for name in SECTIONS}
    vit = wrapper.model.vision_encoder
    weights, buffers = (sum(t.nbytes for t in ts) for ts in (vit.parameters(), vit.buffers()))
    assert weights <= reads["ViT"] <= weights + buffers  # every weight (and the buffers it uses: not RoPE's spare)
    assert all(reads[name] > 0 for name in SECTIONS)
    everything = sum(t.untyped_storage().nbytes() for t in (*wrapper.parameters(), *wrapper.buffers()))
    assert sum(reads.values()) <= everything
    _, whole = flops_and_weights_of(wrapper, (images, token_ids))
    assert whole <= sum(reads.values())  # every weight the whole call reads, some section reads

@pytest.mark.slow  # torch.compile of a section
def test_each_section_re_runs_alone_on_what_the_whole_call_gave_it(wrapper, tiny_model):
    """bench times the sections alone (model.section_calls): every section is found in one call, re-run alone gives what
    it gave inside the call, and the compiled re-run (what bench times) gives it too."""
    from sam3_aoti.model.section_calls import SECTIONS, record_section_calls

    images, token_ids = example_inputs(tiny_model.config, 2, 3, seed=7)
    inside = {}
    hooks = [getattr(wrapper.model, child).register_forward_hook(lambda m, i, out, c=child: inside.setdefault(c, out))
             for child in ("detr_decoder", "mask_decoder")]
    try:
        sections = record_section_calls(wrapper, images, token_ids)
    finally:
        for hook in hooks:
            hook.remove()
    assert list(sections) == list(SECTIONS)
    # text: encoder and projection; DETR encoder: its per-image self-attention, then the encoder over the pairs
    assert [len(sections[name].calls) for name in SECTIONS] == [1, 2, 1, 2, 1, 1, 1]
    with torch.no_grad():
        attended, _ = sections["DETR encoder"].run()
        assert torch.equal(attended, wrapper.encode_image(images)[2])
        decoded, = sections["DETR decoder"].run()
        masks, = sections["mask decoder"].run()
        geometry, = sections["geometry encoder"].run()
        assert torch.equal(decoded[0], inside["detr_decoder"][0])  # ModelOutputs: their first tensor
        assert torch.equal(masks[0], inside["mask_decoder"][0])
        assert torch.equal(geometry, wrapper.encode_image(images)[4])  # the no-box geometry prompt
        compiled = sections["scoring"].compiled(torch.compile, {})
        assert torch.allclose(compiled.run()[0], sections["scoring"].run()[0], atol=1e-5)


@pytest.mark.slow  # torch.compile of a section, at two shapes
def test_a_compiled_section_is_compiled_once_and_timed_at_each_shape(wrapper, tiny_model):
    """bench's "compiled" sections (`time_section`): a section recorded at another shape reuses the callable
    torch.compile gave it at the first, and each shape gets its time, FLOPs and rate."""
    from sam3_aoti.measure.parts import time_section
    from sam3_aoti.model.section_calls import record_section_calls

    compiled, rows = {}, []
    for batch, prompts in ((1, 1), (2, 3)):
        images, token_ids = example_inputs(tiny_model.config, batch, prompts, seed=7)
        scoring = record_section_calls(wrapper, images, token_ids)["scoring"]
        rows.append(time_section(wrapper, scoring, "compiled", compiled, "cpu", {"warmup": 1, "iters": 2}, None))
        if batch == 1:
            first = dict(compiled)
    assert list(compiled) == [("scoring", 0)] and compiled == first  # one torch.compile, kept across shapes
    assert all(r["median_ms"] > 0 and r["flop"] > 0 and r["tflop_per_s"] >= 0 for r in rows)
    assert rows[1]["flop"] > rows[0]["flop"]  # counted per shape


def test_the_load_comparison_times_two_runtimes_and_refuses_what_cannot_load(package_path, tmp_path):
    """scripts/compare_load_times.py: this checkout against a folder copy of its src/ (a revision's stand-in),
    on the tiny package; a runtime that cannot load the file ends the script with one line."""
    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "src", tmp_path / "before" / "src", ignore=shutil.ignore_patterns("__pycache__"))
    script = [sys.executable, str(root / "scripts" / "compare_load_times.py")]
    out = tmp_path / "load"
    proc = subprocess.run([*script, str(package_path), str(tmp_path / "before"), str(root), "--repeats", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert [len(row["seconds"]) for row in report["rows"]] == [1, 1]
    assert all(0 < s < 60 for row in report["rows"] for s in row["seconds"])
    assert "next start, median s" in out.with_suffix(".md").read_text()
    not_a_package = tmp_path / "not.pt2"
    not_a_package.write_bytes(b"not a zip")
    proc = subprocess.run([*script, str(not_a_package), str(tmp_path / "before"), str(root), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "cannot load" in proc.stderr.strip().splitlines()[-1]
