"""model.ops: the project's ops as the model calls them, or inside `torch_forms()` the torch ops they compute (how
the fallback stage exports)."""

import torch

from sam3_aoti.model import ops
from sam3_aoti.model.fp8 import quantize_rows
from sam3_aoti.model.exporting import custom_ops_in


class EveryOp(torch.nn.Module):
    def forward(self, query, key, value, bias_y, bias_x, deltas, w1, b1, w2, b2, bias, rows, row_scales, weight,
                weight_scales):
        return (ops.attention(query, key, value, 0.25), ops.attention(query, key, value, 0.25, bias_y, bias_x),
                ops.box_bias_mlp(deltas, w1, b1, w2, b2),
                ops.fp8_linear_gelu(rows, row_scales, weight, weight_scales, bias))


def test_an_export_inside_torch_forms_calls_none_of_the_projects_ops_and_computes_the_same():
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 5, 16, generator=g) for _ in range(3))
    side = 4  # 16 keys: a 4 x 4 grid, each table `[B, H, Q', side]` for the last Q' queries
    bias_y, bias_x = torch.randn(1, 2, 3, side, generator=g), torch.randn(1, 2, 3, side, generator=g)
    key, value = torch.randn(1, 2, side * side, 16, generator=g), torch.randn(1, 2, side * side, 16, generator=g)
    deltas, w1, b1 = torch.randn(1, 3, side, 2, generator=g), torch.randn(8, 2, generator=g), torch.randn(8, generator=g)
    w2, b2 = torch.randn(2, 8, generator=g), torch.randn(2, generator=g)
    bias = torch.randn(256, generator=g).to(torch.bfloat16)
    rows, row_scales = quantize_rows(torch.randn(6, 64, generator=g))
    weight, weight_scales = quantize_rows(torch.randn(256, 64, generator=g))
    args = (query, key, value, bias_y, bias_x, deltas, w1, b1, w2, b2, bias, rows, row_scales, weight,
            weight_scales.t().contiguous())
    with torch.no_grad():
        with_ops = torch.export.export(EveryOp(), args)
        with ops.torch_forms():
            written_out = torch.export.export(EveryOp(), args)
        assert custom_ops_in(with_ops) == {"sam3_aoti.attention.default", "sam3_aoti.box_bias_mlp.default",
                                           "sam3_aoti.fp8_linear_gelu.default"}
        assert custom_ops_in(written_out) == set()
        for ours, theirs in zip(with_ops.module()(*args), written_out.module()(*args), strict=True):
            assert ours.dtype == theirs.dtype and torch.equal(ours.view(torch.uint8) if ours.element_size() == 1
                                                              else ours, theirs.view(torch.uint8)
                                                              if theirs.element_size() == 1 else theirs)
    assert not ops._torch_forms  # the ops again once the block is left


def test_torch_compile_traces_the_ops_whole():
    """torch.compile (bench's sections, its torch.compile column) traces through `model.ops` without a graph
    break (a ContextVar there stopped it on the H100: `fullgraph=True` failed), and gives the op's outputs."""
    g = torch.Generator().manual_seed(1)
    deltas, w1, b1 = torch.randn(1, 3, 4, 2, generator=g), torch.randn(8, 2, generator=g), torch.randn(8, generator=g)
    w2, b2 = torch.randn(2, 8, generator=g), torch.randn(2, generator=g)
    query, key, value = (torch.randn(1, 2, 5, 16, generator=g) for _ in range(3))

    def both(deltas, w1, b1, w2, b2, query, key, value):
        return ops.box_bias_mlp(deltas, w1, b1, w2, b2), ops.attention(query, key, value, 0.25)

    args = (deltas, w1, b1, w2, b2, query, key, value)
    with torch.no_grad():
        for ours, theirs in zip(torch.compile(both, fullgraph=True, backend="eager")(*args), both(*args), strict=True):
            assert torch.equal(ours, theirs)
