"""How long torch's CPU vector-ISA probe takes in a fresh process: torch's `load_pt2` (and so its
`load_package`) runs it before loading any AOTI model, CUDA ones too (`_load_aoti` -> `get_device_information`
-> `pick_vec_isa`), one Python subprocess importing torch per ISA the CPU has. No package can avoid it;
TORCHINDUCTOR_VEC_ISA_OK=0 skips it. A diagnostic, not part of the pipeline.
Usage: python experiments/isa_probe_time.py
"""

import os
import subprocess
import sys
import time

PROBE = ("import time, torch; t = time.perf_counter(); from torch._inductor.cpu_vec_isa import pick_vec_isa, "
         "valid_vec_isa_list; isas = valid_vec_isa_list(); pick_vec_isa(); "
         "print(f'{time.perf_counter() - t:.2f} s for {len(isas)} ISAs: ' + ', '.join(map(str, isas)))")

for label, extra in [("import torch alone", None), ("ISA probe", {}), ("ISA probe, TORCHINDUCTOR_VEC_ISA_OK=0",
                                                                       {"TORCHINDUCTOR_VEC_ISA_OK": "0"})]:
    t0 = time.perf_counter()
    code = "import torch" if extra is None else PROBE
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **(extra or {})}, capture_output=True, text=True)
    print(f"{label}: {out.stdout.strip() or 'done'} (process {time.perf_counter() - t0:.1f} s)")
