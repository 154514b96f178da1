#!/usr/bin/env bash
# Every H200 figure reported for issues #3-#5, in one detached run (about 20 minutes for all three parts):
#   fp32: full model, toolchain to verify; parity with Meta's SAM3 (GPU test); bench
#   bf16: full model, the same build in a copy of the checkout (side by side); verify; bench
#   tiny: the GPU test (the whole default chain of the tiny profile on CUDA), then bench in its copy
# Builds share the machine's cores, so compile times are upper bounds; the benches run alone, last.
# The device tool ends a call after 10 minutes, so the run is detached and polled:
#   scripts/gpu_full.sh start [PART...]   start it (setsid) with the parts named (default: fp32 bf16 tiny)
#   scripts/gpu_full.sh wait SECS         wait until it ends or SECS pass, then pack reports and logs into
#                                         $OUT/h200-results.tar.gz (whatever exists so far) and print the status
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=/tmp/sam3-aoti-results
BF16=/tmp/sam3-aoti-bf16
SAM3="profile=sam3 weights=random device=cuda"
# The image's CXX (/opt/gcc/bin/g++) links libstdc++ statically, which crashes AOTI loads; the toolchain
# doctor finds /usr/bin/g++ by itself, after an 80 s crashing probe. Set here to save those 80 s.
export CXX=/usr/bin/g++

step() {  # step NAME COMMAND...: log to RESULTS/NAME.log, start and end times to RESULTS/status
    local name=$1 rc
    shift
    echo "$(date +%T) start $name" >> "$RESULTS/status"
    "$@" > "$RESULTS/$name.log" 2>&1
    rc=$?
    echo "$(date +%T) end $name rc=$rc" >> "$RESULTS/status"
    return $rc
}

fp32_chain() {
    step fp32-build scripts/gpu_run.sh toolchain weights export compile $SAM3 precision=fp32 || return 1
    # verify outside doit: the parity test's doit run holds this profile's doit state meanwhile
    step fp32-verify scripts/gpu_run.sh --python -m sam3_aoti.verify --profile sam3 --weights random \
        --device cuda --precision fp32 &
    step fp32-parity-test scripts/gpu_run.sh --pytest -m gpu -k parity tests/test_gpu.py
    wait
}

bf16_chain() {
    rm -rf "$BF16" && mkdir -p "$BF16"
    tar --exclude=./artifacts --exclude=./env/cuda.env -cf - . | tar -xf - -C "$BF16"
    cd "$BF16" && step bf16-build scripts/gpu_run.sh toolchain weights export compile verify $SAM3 precision=bf16
}

tiny_repo() {  # the tiny GPU test's copy of the checkout
    ls -td /tmp/pytest-of-*/pytest-*/test_tiny_pipeline_on_cuda0 2>/dev/null | head -n 1
}

tiny_bench() {  # in the test's copy, with its package; its own dodo and library, not this checkout's
    local repo
    repo=$(tiny_repo)
    [[ -n $repo ]] || return 1
    (cd "$repo" && PYTHONPATH="/tmp/sam3-site:$repo/src" PYTHONUNBUFFERED=1 step tiny-bench python3 -m doit bench device=cuda)
}

run_all() {
    local parts=" $* " pids=()
    scripts/gpu_run.sh --python -c "" || return 1  # install the wheels once, before builds run side by side
    [[ $parts == *" fp32 "* ]] && { fp32_chain & pids+=($!); }
    [[ $parts == *" bf16 "* ]] && { bf16_chain & pids+=($!); }
    [[ $parts == *" tiny "* ]] && { step tiny-gpu-test scripts/gpu_run.sh --pytest -m gpu -k tiny tests/test_gpu.py &
                                    pids+=($!); }
    wait "${pids[@]}"
    [[ $parts == *" fp32 "* ]] && step fp32-bench scripts/gpu_run.sh bench $SAM3 precision=fp32
    [[ $parts == *" bf16 "* ]] && (cd "$BF16" && step bf16-bench scripts/gpu_run.sh bench $SAM3 precision=bf16)
    [[ $parts == *" tiny "* ]] && tiny_bench
    return 0
}

pack() {
    local staging=/tmp/sam3-aoti-pack
    rm -rf "$staging" && mkdir -p "$staging"
    cp -r "$RESULTS" "$staging/logs"
    local tiny
    tiny=$(tiny_repo)
    for tree in "fp32:$PWD/artifacts" "bf16:$BF16/artifacts" "tiny-gpu-test:${tiny:+$tiny/artifacts}"; do
        local name=${tree%%:*} root=${tree#*:}
        [[ -n $root && -d $root ]] || continue
        mkdir -p "$staging/$name"
        (cd "$root" && find . -path '*/verify/reference' -prune -o -path '*/parity/sam3.pt' -prune -o -type f \
            \( -path '*/verify/*' -o -path '*/bench/*' -o -path '*/parity/*' -o -path '*/logs/*' \
            -o -name manifest.json -o -name doctor.json \) -print0 | tar --null -T - -cf -) | tar -xf - -C "$staging/$name"
        ls -l "$root"/*/package > "$staging/$name/package-ls.txt" 2>/dev/null
    done
    nvidia-smi > "$staging/nvidia-smi.txt" 2>&1
    tar -czf "${OUT:-/tmp}/h200-results.tar.gz" -C "$staging" .
}

case "${1:-}" in
    start)
        rm -rf "$RESULTS" && mkdir -p "$RESULTS"
        shift
        setsid nohup bash "$0" run "${@:-fp32 bf16 tiny}" > "$RESULTS/driver.log" 2>&1 < /dev/null &
        echo "started; poll with: scripts/gpu_full.sh wait 570" ;;
    run)
        shift
        run_all $@
        echo "$(date +%T) end all" >> "$RESULTS/status" ;;
    wait)
        deadline=$((SECONDS + ${2:-570}))
        while ! grep -q "end all" "$RESULTS/status" 2>/dev/null && ((SECONDS < deadline)); do sleep 5; done
        pack
        cat "$RESULTS/status"
        for log in "$RESULTS"/*.log; do echo "== $log"; tail -n 4 "$log"; done ;;
    *) echo "usage: scripts/gpu_full.sh start [fp32] [bf16] [tiny] | wait SECONDS" >&2; exit 2 ;;
esac
