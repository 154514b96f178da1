"""CUDA graphs in the package loader: the bookkeeping (on the CPU, a stand-in for the captured graph) and
the switch. On a GPU, test_gpu.py compares the graphed package with the plain runner."""

import pytest
import torch

from helpers import TINY
from sam3_aoti.runtime.cuda_graphs import SWITCH, Captured, CudaGraphRunner, graphs_wanted
from sam3_aoti.runtime.loader import graphs_state, load_package


class ReplayedOnCpu(CudaGraphRunner):
    """A graph that replays by running the model again into the captured output buffers: what a CUDA
    graph does, so static inputs, copied-out outputs and the shape cache are tested without a GPU. Its warm-up
    is a run of the model, as `capture`'s is; `replays` counts the replays."""

    replays = 0

    def capture(self, args):
        inputs = [a.clone() for a in args]
        first = self.runner(*inputs)
        outputs = self.runner(*inputs)
        runner, owner = self.runner, self

        class Graph:
            def replay(self):
                owner.replays += 1
                for held, new in zip(outputs, runner(*inputs)):
                    held.copy_(new)

        return Captured(Graph(), inputs, outputs, first)


def model(x, y):
    return x * 2 + y.sum(), x.sum(-1, keepdim=True)


def test_one_graph_per_shape_new_inputs_each_call_and_outputs_not_overwritten():
    """A shape's first call returns its warm-up's outputs (no replay); later calls replay with their own inputs,
    and no call's result is overwritten by the next."""
    runner = ReplayedOnCpu(model, max_graphs=2)
    a, b = torch.randn(2, 3), torch.randn(4)
    first = runner(a, b)
    assert runner.captures == 1 and runner.replays == 0
    torch.testing.assert_close(first[0], model(a, b)[0])
    second = runner(a + 1, b)  # same shape: replayed with the new inputs
    assert runner.captures == 1 and runner.replays == 1
    torch.testing.assert_close(second[0], model(a + 1, b)[0])
    torch.testing.assert_close(first[0], model(a, b)[0])  # the first result was copied out, not overwritten
    runner(torch.randn(5, 3), b)
    assert runner.captures == 2 and len(runner.graphs) == 2


def test_the_least_recently_used_shape_is_dropped_beyond_max_graphs():
    runner = ReplayedOnCpu(model, max_graphs=2)
    b = torch.randn(4)
    for rows in (1, 2, 1, 3):  # 1 is used again before 3 arrives: 2 is the one dropped
        runner(torch.randn(rows, 3), b)
    assert [key[0][0][0] for key in runner.graphs] == [1, 3]
    assert runner.captures == 3
    for bad in ({"max_graphs": 0}, {"warmup": 0}):
        with pytest.raises(ValueError, match="max_graphs and warmup"):
            CudaGraphRunner(model, **bad)


def test_the_switch(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    assert graphs_wanted(None) and not graphs_wanted(False)
    monkeypatch.setenv(SWITCH, "0")
    assert not graphs_wanted(None) and graphs_wanted(True)
    cuda = {"device": "cuda"}
    assert graphs_state(True, None, cuda, aoti=True) == "on"
    assert graphs_state(True, None, cuda, aoti=False) == "off: exported programs"
    assert graphs_state(False, False, cuda, aoti=True) == "off: cuda_graphs=False"
    assert graphs_state(False, None, cuda, aoti=True) == f"off: {SWITCH}=0"


def test_a_cpu_package_loads_without_graphs(built_repo):
    package = load_package(built_repo / TINY / "package" / "sam3.pt2", cuda_graphs=True)
    assert package.cuda_graphs == "off: a cpu package" and package.graph_runner is None
    assert package.backends["model"] == "aoti"


def test_a_failed_capture_falls_back_to_the_plain_runner_and_says_why():
    class Uncapturable(CudaGraphRunner):
        def capture(self, args):
            raise RuntimeError("operation not permitted when stream is capturing\nmore")

    runner = Uncapturable(model)
    x, y = torch.randn(2, 3), torch.randn(4)
    torch.testing.assert_close(runner(x, y)[0], model(x, y)[0])
    assert runner.failed == "operation not permitted when stream is capturing" and not runner.graphs
    torch.testing.assert_close(runner(x + 1, y)[0], model(x + 1, y)[0])  # later calls: plain, no new capture
