#!/usr/bin/env bash
# How long a new process takes to import torch (and Ray, where it is on the path), and whether torch's sources have
# their bytecode: the GPU machines' actors took 2.8-3.9 s to import what a segment actor imports, this project's 2
# CPUs 1.1-1.3 s (issue #49). Usage: scripts/checks/import_times.sh LABEL [RUNS]; one line a run.
set -uo pipefail
label=${1:?usage: import_times.sh LABEL [RUNS]} runs=${2:-3}
torch_dir=$(python3 -c 'import importlib.util as u, pathlib as p; print(p.Path(u.find_spec("torch").origin).parent)')
cached=$(compgen -G "$torch_dir/__pycache__/__init__.*.pyc" > /dev/null && echo yes || echo no)
echo "$label: torch in $torch_dir, its bytecode there: $cached; PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-}"
for module in torch ray; do
    python3 -c "import $module" 2> /dev/null || continue
    for ((i = 1; i <= runs; i++)); do
        python3 -c "import time; t = time.perf_counter(); import $module; print(f'$label: import $module {time.perf_counter() - t:.2f} s')"
    done
done
