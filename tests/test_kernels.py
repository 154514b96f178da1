"""The project's Triton kernels (runtime/box_bias.py, runtime/attention.py, runtime/gelu_groups.py) against their
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
              "gelu_groups": GELU_GROUPS_KERNEL_CHECK}
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

GELU_GROUPS_KERNEL_CHECK = """
import numpy as np
import torch
import triton.language as tl
from triton._C.libtriton import ir
from triton.runtime.interpreter import _convert_float  # the interpreter's own fp8 cast (see the test)
from sam3_aoti.runtime.gelu_groups import launch_gelu_groups, reference
torch.manual_seed(0)
launches = [{}, {"rows": 16, "groups_first": True}]  # the default launch and the other grid order
for (m, k), launch in [(shape, launch) for shape in [(37, 256), (64, 384), (1, 128)] for launch in launches]:
    x = (torch.randn(m, k) * torch.logspace(-2, 1, k // 128).repeat_interleave(128)).half()
    x[0, :128] = -20.0  # a group GELU takes to zero
    bias = torch.randn(k).half()
    (values, scales), (_, want_scales) = launch_gelu_groups(x, bias, **launch), reference(x, bias)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (m, k) and scales.shape == (k // 128, m)
    torch.testing.assert_close(scales, want_scales, rtol=2e-3, atol=0)  # a GELU a step off may own a max
    quotients = (torch.nn.functional.gelu(x + bias).float().reshape(m, -1, 128) / want_scales.t()[..., None])
    cast = _convert_float(quotients.clamp(-448, 448).numpy(), tl.float32, tl.float8e4nv, ir.ROUNDING_MODE.RTNE)
    same = (np.frombuffer(cast.tobytes(), np.uint8).reshape(m, k) == values.view(torch.uint8).numpy()).mean()
    assert same > 0.999, same  # erf a unit in the last place off can round a value's GELU the other way
"""


@pytest.mark.slow  # Triton's interpreter, in the process the three checks share
@pytest.mark.xdist_group("triton-interpreter")
def test_the_gelu_group_quantization_kernel_is_its_torch_form_in_tritons_interpreter(interpreted):
    """The Triton kernel of the op `sam3_aoti::gelu_quantize_groups` (the fp8 MLP's bias, GELU and 1 x 128 group
    quantization in one pass), run by Triton's CPU interpreter, gives the e4m3 values and scales of its torch
    form (`reference`), for row counts that fill a program's block and that do not, groups decades apart in
    magnitude and one that GELU zeroes, in both grid orders. The interpreter's casts are not CUDA's (it truncates to bf16, and its
    e4m3 rounding drops the carry into the exponent), so the input is fp16 and each value is held to the
    interpreter's own round-to-nearest cast of the torch form's quotient: what is under test is the kernel's
    arithmetic and layout up to the cast; tests/test_gpu.py checks bf16 and the cast against torch on CUDA."""
    assert interpreted["gelu_groups"] == "ok", interpreted["gelu_groups"]
