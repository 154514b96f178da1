"""Why does loading an AOTI CUDA package crash here? Evidence for the toolchain doctor's fix.

Compiles the probe model for CUDA with no fix applied, then reports: compilers and torch's own build
compiler, the wrapper .so's dynamic dependencies and C++ runtime symbols, the libstdc++ copies mapped
in the loading process, and (LD_DEBUG) which library each locale/regex symbol of the wrapper bound to.
Usage: python scripts/checks/diagnose_aoti_load.py [cpu|cuda]
"""

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def sh(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return (proc.stdout + proc.stderr).strip()


print("== versions")
print(sh(os.environ.get("CXX", "g++"), "--version").splitlines()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "cxx11 abi", torch._C._GLIBCXX_USE_CXX11_ABI)
print(next((line.strip() for line in torch.__config__.show().splitlines() if "GCC" in line or "C++ Version" in line), "?"))

tmp = Path(tempfile.mkdtemp())
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)
program = torch.export.export(model, (torch.randn(2, 8, device=device),))
package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp / "probe.pt2"))
with zipfile.ZipFile(package) as z:
    so_name = next(n for n in z.namelist() if n.endswith(".so"))
    z.extract(so_name, tmp)
so = tmp / so_name
print("== wrapper", so.name, so.stat().st_size, "bytes")
print("\n".join(line.strip() for line in sh("readelf", "-d", str(so)).splitlines() if "NEEDED" in line or "RUNPATH" in line))
undefined = sh("nm", "-D", "--undefined-only", str(so)).splitlines()
print("undefined GLIBCXX symbols:", sum("GLIBCXX" in u for u in undefined))
print("undefined locale symbols:", [u.split()[-1] for u in undefined if "locale" in u][:8])
weak_regex = [line for line in sh("nm", "-D", "--defined-only", str(so)).splitlines() if "regex" in line]
print("exported regex symbols:", len(weak_regex))

print("== load in a child process (LD_DEBUG=bindings)")
child = f"""
import torch, torch._inductor.codecache, re
maps = open('/proc/self/maps').read()
print('libstdc++ mapped:', sorted(set(re.findall(r'\\S*libstdc\\+\\+\\S*', maps))), flush=True)
runner = torch._inductor.aoti_load_package({str(package)!r})
print('loaded; output', tuple(runner(torch.randn(3, 8, device={device!r})).shape), flush=True)
"""
log = tmp / "ld.log"
env = {**os.environ, "LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(log)}
proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)
print(proc.stdout.strip())
print("exit:", proc.returncode, "stderr tail:", proc.stderr.strip().splitlines()[-2:])
bindings = []
for path in tmp.glob("ld.log*"):
    bindings += [line for line in path.read_text(errors="replace").splitlines()
                 if so.name in line and re.search(r"locale|regex|ctype", line)]
print(f"{len(bindings)} locale/regex bindings of the wrapper; providers:")
providers = {}
for line in bindings:
    m = re.search(r"to (\S+) \[\d+\]: \w+ symbol `([^']+)'", line)
    if m:
        providers.setdefault(m.group(1), []).append(m.group(2))
for lib, symbols in providers.items():
    print(f"  {lib}: {len(symbols)} symbols, e.g. {symbols[:3]}")
