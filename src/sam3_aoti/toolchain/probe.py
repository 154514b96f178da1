"""AOT-compile, load and run a two-layer model: the cheapest proof that AOTInductor works on this machine.

Run in a subprocess by the toolchain doctor, so a crash in native code (a segfault while loading the
package) is a reported failure with its signal, not the end of the build.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    import torch

    from ..pipeline.vec_isa import skip_known_isa_check
    from ..runtime.scratch import process_folder

    skip_known_isa_check()  # as the compile stage does, so the probe runs what a compile will run

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(args.device)
    x = torch.randn(2, 8, device=args.device)
    batch = torch.export.Dim("batch", min=1)
    t0 = time.perf_counter()
    program = torch.export.export(model, (x,), dynamic_shapes={"input": {0: batch}})
    with tempfile.TemporaryDirectory(dir=process_folder()) as tmp:  # ours, swept if this process is killed
        # The C++ wrapper unoptimized: the probe proves compile-link-load-run, and -O1 would triple its g++ time.
        options = {k: v for k, v in {"aot_inductor.compile_wrapper_opt_level": "O0"}.items()
                   if hasattr(torch._inductor.config.aot_inductor, k.split(".")[1])}
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(Path(tmp) / "probe.pt2"),
                                                        inductor_configs=options)
        compile_s = time.perf_counter() - t0
        print("compiled; loading", file=sys.stderr, flush=True)
        runner = torch._inductor.aoti_load_package(path)
        y = torch.randn(3, 8, device=args.device)
        with torch.no_grad():
            diff = float((runner(y) - model(y)).abs().max())
    print(json.dumps({"compile_seconds": round(compile_s, 1), "max_abs_diff": diff}))
    sys.exit(0 if diff < 1e-4 else 3)


if __name__ == "__main__":
    main()
