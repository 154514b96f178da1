"""How long the loader takes to get a model's weights out of a package into memory, by each way it could: the
blob unpacked through zipfile (a CRC pass and two copies through Python, the loader before 2026-12-05) or copied
by the kernel from the package's bytes (`PackageFile.copy_entry`), into a file or a memfd, then read back as
the runner reads it (mmapped, copied into memory of its own) and released; or no blob at all, each tensor copied
from the package's own pages (`constants.read_constants`, what a package with a weights layout loads by). A
stored archive holding one random blob of `--gb` GB (the full bf16 package's is 1.6 GB) in `--tensors` equal
tensors, page cache warm, on the CPU (on a GPU both the runner and `read_constants` copy to the device as well),
each way `--repeat` times; the median. Writes unpack-times.json into `--out` and prints a table.

Usage: python scripts/checks/unpack_times.py [--gb 1.6] [--tensors 1000] [--repeat 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

BLOB = "sam3/data/aotinductor/model/x_weights.blob"


def write_archive(path: Path, size: int) -> None:
    chunk = os.urandom(1 << 24)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("sam3/archive_format", "pt2")
        with archive.open(BLOB, "w", force_zip64=True) as out:
            for start in range(0, size, len(chunk)):
                out.write(chunk[:min(len(chunk), size - start)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.6)
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()

    import mmap
    import warnings

    import torch

    warnings.filterwarnings("ignore", "The given buffer is not writable")  # read only, into copies

    from sam3_aoti.runtime import integrity
    from sam3_aoti.runtime.constants import InPlace, read_constants
    from sam3_aoti.runtime.reader import stored_data_offset

    folder = Path(tempfile.mkdtemp(prefix="unpack-times-"))
    os.environ["SAM3_AOTI_CACHE"] = str(folder / "cache")
    each = int(args.gb * 1e9) // args.tensors // 64 * 64
    layout = [[f"t{i}", "float32", [each // 4], [1], 0, each, False] for i in range(args.tensors)]
    try:
        path = folder / "sam3.pt2"
        write_archive(path, each * args.tensors)
        integrity.write_digest(path)
        with open(path, "rb") as f:  # page cache warm, as on a service's next start
            while f.read(1 << 26):
                pass
        inner = BLOB.removeprefix("sam3/")

        def read_back(blob) -> None:  # as the runner does: mmapped, copied into memory of its own
            with open(blob, "rb") as f:
                pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                torch.empty(len(pages), dtype=torch.uint8).copy_(torch.frombuffer(pages, dtype=torch.uint8))

        def unpacked(kernel: bool, in_memory: bool):
            def run(package):
                dst = os.fdopen(os.memfd_create("blob"), "w+b") if in_memory else open(folder / "blob", "w+b")
                with dst:
                    if kernel:
                        package.copy_entry(inner, dst)
                    else:
                        with package.zip.open(package.entries[inner]) as src:
                            shutil.copyfileobj(src, dst, 1 << 24)
                    dst.flush()
                    read_back(f"/proc/self/fd/{dst.fileno()}")
                (folder / "blob").unlink(missing_ok=True)
            return run

        def in_place(package):
            start = stored_data_offset(package.file, package.entries[inner])
            read_constants(package, InPlace(inner, start, layout), "cpu")

        ways = {"zipfile into a file, read back": unpacked(False, False),
                "kernel copy into a file, read back": unpacked(True, False),
                "kernel copy into a memfd, read back": unpacked(True, True),
                "in place: the package's pages into tensors": in_place}
        seconds = {}
        for name, way in ways.items():
            times = []
            for _ in range(args.repeat):
                with integrity.PackageFile(path) as package:
                    integrity.check_package(package)
                    t0 = time.perf_counter()
                    way(package)
                    times.append(time.perf_counter() - t0)
            seconds[name] = round(statistics.median(times), 3)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {"blob_gb": args.gb, "tensors": args.tensors, "repeat": args.repeat, "device": "cpu",
              "median_seconds": seconds}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "unpack-times.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, s in seconds.items():
        print(f"{name:44s} {s:7.3f} s  ({args.gb / s:.2f} GB/s)")


if __name__ == "__main__":
    main()
