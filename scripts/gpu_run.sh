#!/usr/bin/env bash
# Run the pipeline on a GPU machine that brings its own torch and reaches no package registry (the H200):
# the project's pinned pure-Python dependencies travel as wheels in .whl/ (scripts/fetch_gpu_wheels.sh),
# installed beside, not over, the machine's packages.
# Usage: scripts/gpu_run.sh [doit arguments...]     or     scripts/gpu_run.sh --pytest [pytest arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sam3-site .whl/*.whl
export PYTHONPATH="/tmp/sam3-site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [[ "${1:-}" == "--pytest" ]]; then
    shift
    python3 -m pytest -p no:cacheprovider "$@"
else
    python3 -m doit "$@"
fi
