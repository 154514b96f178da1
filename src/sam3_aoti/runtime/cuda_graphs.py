"""CUDA graphs around an AOTI runner: one graph per input shape, captured on first use, replayed after.

AOTInductor (torch 2.11) launches every kernel from the host on each call: about 1,800 launches at
(B, P) = (2, 3), with the GPU idle between many of them. A replayed graph issues them all at once. The
runner runs single-threaded (`torch_private.AotiRunner`: torch's default container synchronizes on events,
which a capture forbids). Graphs share one memory pool; inputs are copied into each graph's static
buffers and outputs copied out after each replay, so a caller never sees its results overwritten by
the next call. A shape's first call returns what its warm-up computed (the same inputs, the same kernels)
rather than replaying the graph just recorded: one run of the model and the recording, where two warm-ups and a
replay were three runs (a part of `segment`'s start-up, and of every shape verify and bench try). At most
`max_graphs` shapes are kept, the least recently used dropped first. Should a capture fail (a kernel that cannot
be captured), the runner says why once and runs without graphs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from .torch_private import tree_map

SWITCH = "SAM3_AOTI_CUDA_GRAPHS"  # "0" turns graphs off for every load_package in the process
DEFAULT_MAX_GRAPHS = 8
log = logging.getLogger(__name__)


def graphs_wanted(requested: bool | None) -> bool:
    """`load_package(cuda_graphs=...)` if given, else the environment switch (on unless "0")."""
    if requested is not None:
        return requested
    return os.environ.get(SWITCH, "1") != "0"


class _Uncapturable(Exception):
    pass


@dataclass
class Captured:
    graph: object  # torch.cuda.CUDAGraph
    inputs: list
    outputs: object  # the graph's static output buffers
    first: object = None  # the warm-up's outputs, for the inputs it was captured with: the first call's result


class CudaGraphRunner:
    """`runner(*tensors)` through CUDA graphs, keyed by the inputs' shapes and dtypes."""

    def __init__(self, runner: Callable, max_graphs: int = DEFAULT_MAX_GRAPHS, warmup: int = 1,
                 copy_outputs: bool = True):
        if max_graphs < 1 or warmup < 1:
            raise ValueError("max_graphs and warmup must each be at least 1")
        self.runner, self.max_graphs, self.warmup, self.copy_outputs = runner, max_graphs, warmup, copy_outputs
        self.graphs: OrderedDict[tuple, Captured] = OrderedDict()
        self.captures = 0
        self.failed: str | None = None  # why graphs were given up, if they were
        self._pool = None
        self._lock = threading.Lock()  # one replay at a time: static buffers are shared between calls

    @staticmethod
    def key(args) -> tuple:
        return tuple((tuple(a.shape), a.dtype, a.device) for a in args)

    def __call__(self, *args):
        with self._lock:
            if self.failed:
                return self.runner(*args)
            key = self.key(args)
            entry = self.graphs.get(key)
            if entry is None:
                try:
                    entry = self._add(key, args)
                except _Uncapturable:
                    return self.runner(*args)
                first, entry.first = entry.first, None
                if first is not None:
                    return first
            self.graphs.move_to_end(key)
            for static, a in zip(entry.inputs, args):
                static.copy_(a)
            entry.graph.replay()
            if not self.copy_outputs:
                return entry.outputs
            return tree_map(lambda t: t.clone(), entry.outputs)

    def _add(self, key: tuple, args) -> Captured:
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)  # its memory returns to the shared pool
        try:
            entry = self.capture(args)
        except RuntimeError as e:
            self.failed = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.graphs.clear()
            log.warning("CUDA graph capture failed (%s): the model runs without graphs", self.failed)
            raise _Uncapturable from e
        self.graphs[key] = entry
        self.captures += 1
        return entry

    def capture(self, args) -> Captured:
        """Warm up on a side stream (a first call loads kernels and allocates), then record one call. The warm-up's
        outputs, made on the side stream, are returned as `first`: the current stream waits for it, and they are
        the caller's own tensors, not the graph's buffers."""
        import torch

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        inputs = [a.clone(memory_format=torch.contiguous_format) for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                first = self.runner(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        tree_map(lambda t: t.record_stream(torch.cuda.current_stream()), first)  # freed only after the caller's use
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self.runner(*inputs)
        return Captured(graph, inputs, outputs, first)
