"""Where an AOTI package's load time goes on a GPU (a diagnostic, not part of the pipeline).

A synthetic model with SAM3's weight volume (24 bf16 Linear(5120, 5120), 1.26 GB) is AOT-compiled three ways:
weights in the shared object (torch's default), appended to it and mmapped (`force_mmap_weights`), and in a
separate blob (`binary_blob`, what `compile` does). Each package is then loaded in a fresh process by torch's
C++ loader (what `sam3_aoti.load_package` uses), and the blob package also by torch's Python loaders,
with and without their CPU vector-ISA probe (TORCHINDUCTOR_VEC_ISA_OK=0).
Usage: python scripts/probe_load.py OUTDIR     (prints one line per measurement)
"""

import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "in-so": {},
    "mmap-self": {"aot_inductor.force_mmap_weights": True},
    "blob": {"aot_inductor.package_constants_in_so": False,
             "aot_inductor.package_constants_on_disk_format": "binary_blob", "always_keep_tensor_constants": True},
}
LOAD = """
import sys, time, torch
torch.zeros(1, device="cuda")
t0 = time.perf_counter()
loader = torch._C._aoti.AOTIModelPackageLoader(sys.argv[1], "model", False, 1, -1)
torch.cuda.synchronize()
t1 = time.perf_counter()
loader.boxed_run([torch.randn(8, 5120, device="cuda", dtype=torch.bfloat16)])
torch.cuda.synchronize()
print(f"load {t1 - t0:.2f} s, first run {time.perf_counter() - t1:.2f} s")
"""
PYTHON_LOAD = """
import sys, time, torch
torch.zeros(1, device="cuda")
from torch._inductor.package import load_package
t0 = time.perf_counter()
load_package(sys.argv[1], "model")
print(f"torch load_package {time.perf_counter() - t0:.2f} s")
"""


def build(out: Path) -> None:
    import torch
    from torch.export.pt2_archive._package import package_pt2

    model = torch.nn.Sequential(*[torch.nn.Linear(5120, 5120) for _ in range(24)]).to("cuda", torch.bfloat16).eval()
    x = torch.randn(8, 5120, device="cuda", dtype=torch.bfloat16)
    program = torch.export.export(model, (x,))
    for name, options in VARIANTS.items():
        t0 = time.perf_counter()
        files = torch._inductor.aot_compile(program.module(), (x,), options={"aot_inductor.package": True, **options})
        package_pt2(str(out / f"{name}.pt2"), aoti_files={"model": files})
        print(f"{name}: compiled and packaged in {time.perf_counter() - t0:.1f} s, "
              f"{(out / f'{name}.pt2').stat().st_size / 1e9:.2f} GB", flush=True)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    build(out)
    for name in VARIANTS:
        for attempt in (1, 2):
            proc = subprocess.run([sys.executable, "-c", LOAD, str(out / f"{name}.pt2")], capture_output=True, text=True)
            print(f"{name} #{attempt}: {proc.stdout.strip() or proc.stderr.strip().splitlines()[-1]}", flush=True)
    for env in ({}, {"TORCHINDUCTOR_VEC_ISA_OK": "0"}):
        proc = subprocess.run([sys.executable, "-c", PYTHON_LOAD, str(out / "blob.pt2")], capture_output=True,
                              text=True, env={**os.environ, **env})
        print(f"blob {env or 'default env'}: {proc.stdout.strip() or proc.stderr.strip().splitlines()[-1]}", flush=True)


if __name__ == "__main__":
    main()
