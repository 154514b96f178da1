#!/usr/bin/env bash
# Run the pipeline on a GPU machine that brings its own torch and reaches no package registry (the H200):
# the project's pinned pure-Python dependencies travel as wheels in .whl/ (scripts/fetch_gpu_wheels.sh),
# installed once beside, not over, the machine's packages.
# Usage: scripts/gpu_run.sh [doit arguments...]
#        scripts/gpu_run.sh --pytest [pytest arguments...]
#        scripts/gpu_run.sh --python [python arguments...]     (e.g. -m sam3_aoti.verify --profile sam3)
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/sam3-site
wheels=$(ls .whl | sha256sum)
if [[ "$(cat "$SITE/.wheels" 2>/dev/null)" != "$wheels" ]]; then  # builds side by side must not reinstall
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    echo "$wheels" > "$SITE/.wheels"
fi
export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
case "${1:-}" in
    --pytest) shift; exec python3 -m pytest -p no:cacheprovider "$@" ;;
    --python) shift; exec python3 "$@" ;;
    *) exec python3 -m doit "$@" ;;
esac
