"""The project's Triton kernels (runtime/box_bias.py, runtime/attention.py, runtime/fp8_linear.py) against their
reference, in Triton's CPU interpreter (tests/test_gpu.py runs them compiled on CUDA)."""

import os
import subprocess
import sys

import pytest

RUN_CHECKS = """
import json, sys, traceback
for name, code in json.load(sys.stdin).items():
    try:
        exec(compile(code, name, "exec"), {"__name__": name})
        print(json.dumps({name: "ok"}), flush=True)
    except BaseException:
        print(json.dumps({name: traceback.format_exc()[-3000:]}), flush=True)
"""


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Each kernel check's verdict ("ok", or its traceback), all run in one process under Triton's interpreter
    (`TRITON_INTERPRET=1`): one import of torch and Triton, not three. The tests share an xdist group."""
    import json

    pytest.importorskip("triton")
    checks = {"box_bias": TRITON_KERNEL_CHECK, "attention": ATTENTION_KERNEL_CHECK,
              "fp8_linear": FP8_LINEAR_KERNEL_CHECK, "fp8_linear_rope": FP8_ROPE_KERNEL_CHECK}
    proc = subprocess.run([sys.executable, "-c", RUN_CHECKS], input=json.dumps(checks), capture_output=True,
                          text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    found = {k: v for line in proc.stdout.splitlines() if line.startswith("{") for k, v in json.loads(line).items()}
    return {name: found.get(name, f"no verdict (exit {proc.returncode}): {proc.stderr[-2000:]}") for name in checks}


TRITON_KERNEL_CHECK = """
import torch
from transformers.models.sam3.modeling_sam3 import Sam3DecoderMLP
from sam3_aoti.runtime.box_bias import launch_box_bias
torch.manual_seed(0)
for hidden, heads in [(32, 2), (256, 8), (48, 3)]:
    mlp = Sam3DecoderMLP(2, hidden, heads, 2)
    for p in mlp.parameters():
        p.data.normal_()
    deltas = torch.randn(3, 5, 7, 2)
    got = launch_box_bias(deltas, mlp.layer1.weight, mlp.layer1.bias, mlp.layer2.weight, mlp.layer2.bias)
    with torch.no_grad():
        torch.testing.assert_close(got, mlp(deltas).permute(0, 3, 1, 2), atol=1e-4, rtol=1e-5)
"""

@pytest.mark.slow  # Triton's interpreter, in the process the three checks share
@pytest.mark.xdist_group("triton-interpreter")
def test_the_box_bias_kernel_is_the_mlp_in_tritons_interpreter(interpreted):
    """The Triton kernel of the op `sam3_aoti::box_bias_mlp`, run by Triton's CPU interpreter (`TRITON_INTERPRET=1`), gives the
    MLP's output in `[N, heads, Q, side]` for widths that are and are not powers of two (fp32 weights: the
    interpreter's bf16 dot is wrong; tests/test_gpu.py checks bf16 on CUDA)."""
    assert interpreted["box_bias"] == "ok", interpreted["box_bias"]

ATTENTION_KERNEL_CHECK = """
import torch
from sam3_aoti.runtime.attention import launch_attention, reference
torch.manual_seed(0)
# (pairs, heads, queries, grid rows, grid side, head dim, config): uneven and even key blocks, a non-square grid
for n, h, lq, rows, side, d, config in [(2, 3, 37, 6, 8, 32, (16, 16, 4, 1)), (1, 2, 40, 3, 16, 16, (32, 16, 4, 1)),
                                        (2, 2, 64, 8, 8, 32, (32, 32, 4, 1)), (1, 2, 20, 9, 8, 32, (16, 64, 4, 1)),
                                        (2, 1, 24, 3, 8, 64, (16, 16, 4, 1))]:  # the ViT's head dim
    q, k, v = (torch.randn(n, length, h, d).transpose(1, 2) for length in (lq, rows * side, rows * side))
    tables = torch.randn(n, h, lq, rows), torch.randn(n, h, lq, side)
    below_first = torch.randn(n, h, lq - 1, rows), torch.randn(n, h, lq - 1, side)  # row 0 unbiased
    for bias in (tables, below_first, (None, None)):
        got = launch_attention(q, k, v, 0.3, *bias, config=config)
        assert got.shape == (n, lq, h, d)
        torch.testing.assert_close(got, reference(q, k, v, 0.3, *bias), atol=1e-5, rtol=1e-5)
"""

@pytest.mark.slow  # Triton's interpreter, in the process the three checks share
@pytest.mark.xdist_group("triton-interpreter")
def test_the_attention_kernel_is_sdpa_in_tritons_interpreter(interpreted):
    """The Triton kernel of the op `sam3_aoti::attention`, run by Triton's CPU interpreter, is SDPA on strided
    `[B, H, L, D]` views, with a grid bias from a non-square pair of tables (for every query, or for all but the
    first, as the decoder's presence token has it) and without one, for key lengths
    that are and are not a multiple of the key block (fp32: tests/test_gpu.py checks bf16 on CUDA)."""
    assert interpreted["attention"] == "ok", interpreted["attention"]

FP8_LINEAR_KERNEL_CHECK = """
import torch
from sam3_aoti.model.fp8 import quantize_rows
from sam3_aoti.runtime.fp8_linear import launch_linear_gelu, reference
torch.manual_seed(0)
launches = [{}, {"block_m": 32, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 1}]
for (m, k, n), launch in [((37, 256, 384), launches[0]), ((37, 256, 200), launches[1]), ((1, 96, 64), launches[1])]:
    rows, row_scales = quantize_rows(torch.randn(m, k) * torch.logspace(-2, 1, m)[:, None])
    weight, weight_scales = quantize_rows(torch.randn(n, k) * 0.05)
    weight_scales = weight_scales.t().contiguous()
    bias = (torch.randn(n) * torch.logspace(-2, 1, n)).bfloat16()
    bias[:32] = -40.0  # columns the GELU takes to (nearly) zero in every row
    got = launch_linear_gelu(rows, row_scales, weight, weight_scales, bias, approx_tanh=False, **launch)
    want = reference(rows, row_scales, weight, weight_scales, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-5)  # bf16: one rounding step apart at most
"""


@pytest.mark.slow  # Triton's interpreter, in the process the checks share
@pytest.mark.xdist_group("triton-interpreter")
def test_the_fp8_fc1_kernel_is_its_torch_form_in_tritons_interpreter(interpreted):
    """The Triton kernel of the op `sam3_aoti::fp8_linear_gelu` (fc1's fp8 product with its row and column scales,
    bias and tanh GELU in the epilogue, bf16 out), run by Triton's CPU interpreter, gives its torch form with fc1's
    launch (a 256-wide tile past a 384-wide output's end), a smaller one over widths that are not a multiple of
    it, a depth that is not a multiple of the tile's, and rows decades apart. The interpreter's tanh is computed
    through exp where CUDA's kernel takes the SFU's (tests/test_gpu.py checks that on CUDA)."""
    assert interpreted["fp8_linear"] == "ok", interpreted["fp8_linear"]


FP8_ROPE_KERNEL_CHECK = """
import torch
from sam3_aoti.model.fp8 import quantize_rows
from sam3_aoti.runtime.fp8_linear import launch_linear_rope, rope_reference
torch.manual_seed(0)
small = {"block_m": 32, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 1}
# (positions, head dim, heads, images, depth, launch); 3 x heads x head dim outputs, q's and k's rotated
for positions, dim, heads, images, k, launch in [(48, 64, 4, 2, 256, {}), (20, 16, 4, 3, 96, small),
                                                  (36, 32, 2, 1, 64, small), (20, 16, 4, 2.5, 96, small)]:
    m, n, rotated = int(positions * images), 3 * heads * dim, 2 * heads * dim
    rows, row_scales = quantize_rows(torch.randn(m, k) * torch.logspace(-2, 1, m)[:, None])
    weight, weight_scales = quantize_rows(torch.randn(n, k) * 0.05)
    weight_scales = weight_scales.t().contiguous()
    bias = (torch.randn(n) * 0.1).bfloat16()
    angles = torch.rand(positions, dim // 2) * 40
    got = launch_linear_rope(rows, row_scales, weight, weight_scales, bias, angles.cos(), angles.sin(), rotated,
                             **launch)
    want = rope_reference(rows, row_scales, weight, weight_scales, bias, angles.cos(), angles.sin(), rotated)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-5)  # bf16: one rounding step apart at most
"""


@pytest.mark.slow  # Triton's interpreter, in the process the checks share
@pytest.mark.xdist_group("triton-interpreter")
def test_the_fp8_qkv_rope_kernel_is_its_torch_form_in_tritons_interpreter(interpreted):
    """The Triton kernel of the op `sam3_aoti::fp8_linear_rope` (the ViT's q, k, v projection in fp8 with q's and k's
    heads rotated in the epilogue), run by Triton's CPU interpreter, gives its torch form: with the ViT's launch
    (256-wide tiles, q and k two of them each) and a smaller one whose row tiles straddle the positions' period
    (row r at position r % L; rows that end inside a period too), heads of 16, 32 and 64 channels."""
    assert interpreted["fp8_linear_rope"] == "ok", interpreted["fp8_linear_rope"]
