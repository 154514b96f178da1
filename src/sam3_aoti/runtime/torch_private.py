"""Every call the runtime makes into torch's private API, in one place: the file to read when torch is upgraded.

AOTInductor's model runners (`torch._C._aoti`), the exported-program archive reader (`load_pt2`), pytree's
spec and tree functions, and the version shims. Each is a thin wrapper; what they do is the loader's business.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from ..errors import PackageError
from .archive import BLOB_SUFFIX


def before_loading() -> None:
    """torch 2.10 needs Inductor's code cache imported before AOTI packages load (3 s); 2.11 and later do not."""
    import torch

    if torch.__version__ < "2.11":
        import torch._inductor.codecache  # noqa: F401


class AotiRunner:
    """One AOTI model unpacked into `folder` (`loader.unpack_model`: this process's own temporary folder; torch's
    package loader would unpack into /tmp/XXXXXX, left there when a load is interrupted), loaded with torch's
    model runner, called with tensors. Its weights are `weights` (tensors on its device, read in place), or else
    read from the blob in the folder, which is then removed: the code stays
    for the life of the runner (CUDA kernels load on first use). The runner owns the folder. Inputs are made
    contiguous: the runner reads dense row-major memory, and a permuted view (an HWC image turned CHW) would be
    read wrongly, silently.

    On CUDA it runs single-threaded, one call at a time under its own lock: torch's default runner keeps one
    model instance and, before each call, waits on the host for the last call's kernels to finish (a
    `transforms` call per image waited for the image before; two threads on one stream, for each other's whole
    model). Under the lock a call only queues its kernels, and a CUDA graph can record it."""

    def __init__(self, folder: Path, device: str = "cpu", weights: dict | None = None):
        import threading
        import weakref

        import torch
        from torch.utils import _pytree

        self._cleanup = weakref.finalize(self, shutil.rmtree, folder, True)
        shared = sorted(folder.glob("*.wrapper.so")) or sorted(folder.glob("*.so"))
        if device == "cuda":
            self.runner = torch._C._aoti.AOTIModelContainerRunnerCuda(str(shared[0]), 1, "cuda", str(folder), True)
        else:
            self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(shared[0]), 1)
        self.weights = weights  # the runner reads these tensors in place (user-managed): they live as long as it
        if weights is not None:  # built from the package's bytes (`constants.read_constants`)
            self.runner.update_constant_buffer(weights, False, True, True)
        for blob in folder.glob(f"*{BLOB_SUFFIX}"):
            self.runner.update_constant_buffer_from_blob(str(blob))
            blob.unlink()  # read into the runner's constants: a second copy on disk helps no one
        self.out_spec = _pytree.treespec_loads(self.runner.get_call_spec()[1])
        self._lock = threading.Lock()

    def __call__(self, *args):
        from torch.utils import _pytree

        inputs = [a.contiguous() for a in args]
        with self._lock:
            outputs = self.runner.run(inputs)
        return _pytree.tree_unflatten(outputs, self.out_spec)

    def read_weights_of(self, other: "AotiRunner") -> None:
        """Point this model's constants at `other`'s tensors of the same names, uncopied (user-managed): a part
        of the split model reads `model`'s weights, so they sit in memory once."""
        theirs = other.runner.extract_constants_map(False)  # by original name (fqn)
        mine = self.runner.get_constant_names_to_original_fqns()  # this model's own name -> fqn
        missing = sorted(fqn for fqn in mine.values() if fqn not in theirs)
        if missing:
            raise PackageError(f"a part of the package reads {len(missing)} tensors model lacks ({missing[0]}...): "
                               "rebuild it with `uv run doit package`")
        self.runner.update_constant_buffer({k: theirs[fqn] for k, fqn in mine.items()}, False, True, True)


def tree_map(fn, tree):
    from torch.utils import _pytree

    return _pytree.tree_map(fn, tree)


def exported_programs(file) -> dict:
    """The exported programs of a PT2 archive, read from an open file (torch's archive reader)."""
    from torch.export.pt2_archive._package import load_pt2

    quicker_program_reads()
    return load_pt2(file).exported_programs


def exported_program(archive, name: str):
    """One exported program of a PT2 archive, the others left unread: deserializing a graph is most of a program's
    load, and a compile worker needs only its own."""
    from torch.export.pt2_archive._package import PT2ArchiveReader, _load_exported_programs

    quicker_program_reads()
    with PT2ArchiveReader(str(archive)) as reader:
        return _load_exported_programs(reader, [f"models/{name}.json"], None)[name]


def quicker_program_reads() -> None:
    """torch's exported-program reader (`serde.serialize._dict_to_dataclass`) asks `typing.get_type_hints` about
    a schema class for every serialized node, tensor and argument: 93,000 times for the tiny model's fallback, a
    quarter of its read (8.4 -> 6.2 s). The answer depends on the class alone, so it is kept per class. Only that
    module's `typing` is replaced, and only while it is the real one."""
    import functools
    import types
    import typing

    from torch._export.serde import schema, serialize

    if getattr(serialize, "typing", None) is not typing:
        return  # done already, or another torch whose reader this does not know
    namespace = vars(schema)
    hints = functools.cache(lambda cls: typing.get_type_hints(cls, globalns=namespace))

    def get_type_hints(obj, globalns=None, localns=None, include_extras=False):
        if globalns is namespace and localns is None and not include_extras:
            return hints(obj)
        return typing.get_type_hints(obj, globalns, localns, include_extras)

    shim = types.ModuleType("typing")
    shim.__dict__.update(vars(typing))
    shim.get_type_hints = get_type_hints
    serialize.typing = shim


@contextlib.contextmanager
def writes_without_self_check():
    """While open, torch's exported-program writer skips its self-check: it puts each serialized program in a
    canonical form (`serialize.canonicalize`, on a deep copy of the program's whole schema tree), drops the
    result and writes the program as it serialized it. The check was 40 % of a save (2.3 of 5.8 s for the tiny
    model's programs); the bytes written are torch's either way, and a program that could not be read back is
    still found where it is read (compile reads each program, the fallback's stages read their archive)."""
    from torch._export.serde import serialize

    real = getattr(serialize, "canonicalize", None)
    if real is None:  # another torch, whose writer this does not know
        yield
        return
    serialize.canonicalize = lambda *args, **kwargs: None
    try:
        yield
    finally:
        serialize.canonicalize = real
