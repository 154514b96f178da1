"""runtime.torch_private: the runtime's calls into torch's private API."""

import subprocess
import sys

from helpers import REPO

READ_TWICE = """
import io, sys, torch
from torch.export.pt2_archive._package import load_pt2, package_pt2
from sam3_aoti.runtime.torch_private import exported_programs

class Net(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x[:, :3] * 2).sum(-1)

program = torch.export.export(Net(), (torch.randn(2, 5),), dynamic_shapes=({0: torch.export.Dim("b")},))
buffer = io.BytesIO()
package_pt2(buffer, exported_programs={"net": program})
plain = load_pt2(io.BytesIO(buffer.getvalue())).exported_programs["net"]
ours = exported_programs(io.BytesIO(buffer.getvalue()))["net"]
from torch._export.serde import serialize
assert serialize.typing.get_type_hints is not __import__("typing").get_type_hints, "not installed"
assert str(ours.graph) == str(plain.graph) and ours.range_constraints.keys() == plain.range_constraints.keys()
x = torch.randn(4, 5)
assert torch.equal(ours.module()(x), plain.module()(x))
print("ok")
"""


def test_programs_read_with_the_kept_type_hints_are_the_programs_torch_reads():
    """`quicker_program_reads` keeps the serde reader's type hints per class: the programs read so are the ones
    torch's own reader gives (graph, dynamic ranges, outputs). In a fresh process: the reader is patched for
    good."""
    proc = subprocess.run([sys.executable, "-c", READ_TWICE], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


WRITE_TWICE = """
import io, torch
from torch.export.pt2_archive._package import package_pt2
from torch._export.serde import serialize
from sam3_aoti.runtime.torch_private import writes_without_self_check

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 3)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x)).sum(-1)

program = torch.export.export(Net(), (torch.randn(2, 5),), dynamic_shapes=({0: torch.export.Dim("b")},))
real, checks, saved = serialize.canonicalize, [], []
serialize.canonicalize = lambda *args, **kwargs: checks.append(1) or real(*args, **kwargs)
for skipped in (False, True):
    buffer = io.BytesIO()
    with writes_without_self_check() if skipped else __import__("contextlib").nullcontext():
        package_pt2(buffer, exported_programs={"net": program})
    saved.append(buffer.getvalue())
    assert len(checks) == 1, "the writer no longer runs its check: the shim has no reason to exist"
assert saved[0] == saved[1]
package_pt2(io.BytesIO(), exported_programs={"net": program})
assert len(checks) == 2, "the check did not come back after the block"
print("ok")
"""


def test_programs_written_without_the_writers_self_check_are_the_bytes_torch_writes():
    """`writes_without_self_check` skips the canonical form torch's writer computes and drops: the archive is
    byte for byte the one torch's own writer gives, the writer runs that check without it (else the shim has no
    reason to exist), and the check is back once the block ends."""
    proc = subprocess.run([sys.executable, "-c", WRITE_TWICE], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_a_cuda_runner_runs_single_threaded_one_call_at_a_time(tmp_path, monkeypatch):
    """torch's default CUDA runner waits on the host for the last call's kernels before the next: two threads on
    one stream (segment's actor) then wait for each other's model. Ours is loaded single-threaded and takes one
    call at a time under its lock (here with torch's runner replaced by one that counts calls at once)."""
    import threading
    import time

    import torch
    from torch.utils import _pytree

    from sam3_aoti.runtime import torch_private

    made, running, most = [], [], []

    class Runner:
        def __init__(self, *args):
            made.append(args)

        def get_call_spec(self):
            return "", _pytree.treespec_dumps(_pytree.tree_flatten([torch.zeros(1)])[1])

        def run(self, inputs):
            running.append(1)
            most.append(len(running))
            time.sleep(0.05)
            running.pop()
            return [inputs[0] + 1]

    monkeypatch.setattr(torch._C._aoti, "AOTIModelContainerRunnerCuda", Runner)
    (tmp_path / "m.wrapper.so").write_bytes(b"")
    runner = torch_private.AotiRunner(tmp_path, "cuda")
    assert made[0][-1] is True  # single-threaded: no wait on the last call's event
    results = []
    threads = [threading.Thread(target=lambda: results.append(runner(torch.zeros(2)))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert max(most) == 1 and len(results) == 4 and all(torch.equal(r[0], torch.ones(2)) for r in results)
