"""What one call computes and reads: FLOPs (torch's FlopCounterMode: matmuls, convolutions, attention, and the
project's ops, which register their counts) and the bytes of the weights it reads (a dispatch mode)."""

from __future__ import annotations

import functools


def flop_counter():
    """torch's FlopCounterMode, counting also the GEMMs with an activation in their epilogue
    (`aten._addmm_activation`: `relu_epilogue`, `vit_gelu_epilogue`), which it has no count for: an addmm's."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, addmm_flop, flop_registry, register_flop_formula

    if torch.ops.aten._addmm_activation not in flop_registry:  # (bias, mat1, mat2, beta, alpha, use_gelu)
        register_flop_formula(torch.ops.aten._addmm_activation)(
            lambda bias, mat1, mat2, *args, out_shape=None, **kwargs: addmm_flop(bias, mat1, mat2))
    return FlopCounterMode(display=False)


def flops_of(module, args, call=None) -> int:
    """FLOPs of one call of `module` (or of `call`, one of its methods), counted by torch's FlopCounterMode
    (matmuls, convolutions, attention)."""
    counter = flop_counter()
    run_under(module, args, call, counter)
    return counter.get_total_flops()


def flops_and_weights_of(module, args, call=None) -> tuple[int, int]:
    """`flops_of`, and the bytes of `module`'s weights the same call reads (`weights_read`)."""
    counter, reads = flop_counter(), weights_read(module)
    run_under(module, args, call, counter, reads)
    return counter.get_total_flops(), reads.bytes


def run_under(module, args, call, *modes):
    """One no_grad call of `module` (or `call`) under `modes`, its result returned. FlopCounterMode's module tracker hooks autograd,
    which no_grad tensors of parameters that require grad trip over: they are frozen for the call."""
    import contextlib

    import torch

    trainable = [p for p in module.parameters() if p.requires_grad]
    try:
        for p in trainable:
            p.requires_grad_(False)
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            return (call or module)(*args)
    finally:
        for p in trainable:
            p.requires_grad_(True)


def weights_read(module):
    """A dispatch mode that counts, in `.bytes`, the bytes of `module`'s parameters and buffers that the ops run
    under it read, each storage once (a view of a weight, its transpose or a slice, counts as all of it; of an
    embedding table, the rows looked up): what a part moves at least once per call, whatever its kernels."""
    return _weights_read_mode()(module)


@functools.lru_cache(maxsize=1)
def _weights_read_mode():  # made on first use: doit imports no torch at load
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class WeightsRead(TorchDispatchMode):
        def __init__(self, module):
            super().__init__()
            self.sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                          for t in (*module.parameters(), *module.buffers())}
            self.read: set[int] = set()
            self.rows: dict[int, tuple[int, set]] = {}  # embedding table -> (bytes per row, rows looked up)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if func is torch.ops.aten.embedding.default:  # (table, indices, ...): the table's rows it gathers
                table, indices = args[0], args[1]
                row_bytes, rows = self.rows.setdefault(table.untyped_storage().data_ptr(),
                                                       (table[0].nbytes, set()))
                rows.update(indices.unique().tolist())
                tensors = tensors[1:]
            self.read.update(p for p in (t.untyped_storage().data_ptr() for t in tensors) if p in self.sizes)
            return func(*args, **kwargs)

        @property
        def bytes(self) -> int:
            gathered = sum(row_bytes * len(rows) for ptr, (row_bytes, rows) in self.rows.items()
                           if ptr in self.sizes and ptr not in self.read)
            return sum(self.sizes[ptr] for ptr in self.read) + gathered

    return WeightsRead
