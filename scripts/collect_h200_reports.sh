#!/usr/bin/env bash
# Copy the reports of one `scripts/gpu_full.sh` run (its h200-results.tar.gz) into benchmarks/h200-DATE/, the
# committed record of what the H200 measured: verify, parity, bench, the toolchain doctor and each step's times.
# Usage: scripts/collect_h200_reports.sh RESULTS.tar.gz DATE
set -euo pipefail
cd "$(dirname "$0")/.."
tarball=$(realpath "$1") date=$2
dest=benchmarks/h200-$date staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
tar -xzf "$tarball" -C "$staging"
mkdir -p "$dest"
copy() {  # copy SOURCE NAME: when the run produced it
    [[ -f $staging/$1 ]] && cp "$staging/$1" "$dest/$2" || echo "not in this run: $1" >&2
}
compile_facts() {  # compile_facts INDEX OUT: a compile index without its constants tables (400 kB)
    python3 -c 'import json, sys
index = json.load(open(sys.argv[1]))
keep = ("compile_seconds", "compile_phases", "inductor_options", "sdpa_backends", "platform", "tuning", "program_sha256",
        "toolchain")
json.dump({k: index.get(k) for k in keep}, open(sys.argv[2], "w"), indent=2, sort_keys=True)' "$1" "$2"
}
for run in bf16 fp32 parity fast tuned fp8 o0 loader split segment fresh; do  # gpu_full.sh's runs that build a full variant (all but fp32 and fp8: bf16)
    precision=$run
    [[ $run != fp32 && $run != fp8 ]] && precision=bf16
    variant=$run/sam3-$precision-cuda
    copy "$variant/verify/report.md" "verify-$run.md"
    copy "$variant/verify/report.json" "verify-$run.json"
    copy "$variant/bench/bench.md" "bench-$run.md"
    copy "$variant/bench/bench.json" "bench-$run.json"
    copy "$variant/bench/bench.png" "bench-$run.png"
    copy "$variant/parity/parity.md" "parity-$run.md"
    copy "$variant/parity/parity.json" "parity-$run.json"
    [[ -f $staging/$variant/compiled/index.json ]] && compile_facts "$staging/$variant/compiled/index.json" "$dest/compile-$run.json"
    [[ -f $staging/$variant/compiled_parts/index.json ]] && compile_facts "$staging/$variant/compiled_parts/index.json" \
        "$dest/compile-parts-$run.json"
    copy "$variant/tuning/index.json" "tuning-$run.json"
    copy "$run/toolchain/doctor.json" "doctor-$run.json"
    copy "$run/toolkit.txt" "toolkit-$run.txt"
    copy "$run/info.txt" "info-$run.txt"
    copy "logs/$run-tune.log" "tune-$run.log"
    copy "$variant/throughput/throughput.md" "throughput-$run.md"
    copy "$variant/throughput/throughput.json" "throughput-$run.json"
    copy "$variant/logs/throughput.log" "throughput-$run.log"
done
copy logs/segment-bench.log segment-bench.log
copy ceiling/tiny-fp32-cuda/throughput/throughput.md throughput-ceiling.md
copy ceiling/tiny-fp32-cuda/throughput/throughput.json throughput-ceiling.json
copy logs/ceiling-throughput.log ceiling-throughput.log
copy logs/ceiling-gpu-test.log ceiling-gpu-test.log
copy logs/segment-throughput.log segment-throughput.log
copy logs/segment-actor/segment-actor.json segment-actor.json
copy logs/segment-actor.log segment-actor.log
copy tiny/toolchain/doctor.json doctor-tiny.json
copy tiny/tiny-fp32-cuda/verify/report.md verify-tiny.md
copy logs/status steps.txt
copy logs/install-wheels.log install-wheels.log
copy logs/tiny-chain.log tiny-chain.log
copy logs/tiny-cpp-consumer.log tiny-cpp-consumer.log
copy logs/tiny-gpu-tests.log tiny-gpu-tests.log
copy logs/sdpa-backends.json sdpa-backends.json
copy logs/sdpa-backends.log sdpa-backends.txt
copy logs/attention/attention-kernel.json attention-kernel.json
copy logs/attention/attention-kernel.md attention-kernel.md
copy logs/attention-gpu-tests.log attention-gpu-tests.log
copy logs/fp8-gpu-test.log fp8-gpu-tests.log
copy logs/vit-mlp-fp8/vit-mlp-fp8.json vit-mlp-fp8.json
copy logs/vit-mlp-fp8/vit-mlp-fp8.md vit-mlp-fp8.md
copy logs/fp8-aoti-pieces.log fp8-aoti-pieces.log
copy logs/qkv-rope-gpu-test.log qkv-rope-gpu-tests.log
copy logs/fp8-qkv-rope/fp8-qkv-rope.json fp8-qkv-rope.json
copy logs/fp8-qkv-rope/fp8-qkv-rope.md fp8-qkv-rope.md
copy logs/fp8-qkv-rope-launches.log fp8-qkv-rope-launches.txt
copy logs/ray-start/ray-start.json ray-start.json
copy logs/segment-startup.json segment-startup.json
copy logs/segment-startup.log segment-startup.log
copy logs/ray-start.log ray-start.log
for dir in gelu-groups-tune gelu-groups-arithmetic fp8-fc1-fused vit-attention vit-block vit-section-bf16 vit-section-fp8 \
    vit-section-{bf16,fp8}-{pipeline,without-fused-qkv}; do
    [[ -d $staging/logs/$dir ]] && rm -rf "${dest:?}/$dir" && cp -r "$staging/logs/$dir" "$dest/$dir"
done
for dir in "$staging"/logs/actor-*/; do  # the actors run: segment_actor.py with this code and the code before
    [[ -d $dir ]] || continue
    name=$(basename "$dir")
    copy "logs/$name/segment-actor.json" "$name.json"
    copy "logs/$name.log" "$name.log"
done
copy nvidia-smi.txt nvidia-smi.txt
for run in cold warm; do
    [[ -f $staging/logs/compiled-$run.json ]] && compile_facts "$staging/logs/compiled-$run.json" "$dest/compile-$run.json"
done
copy compiletime/toolkit.txt toolkit-compiletime.txt
if [[ -d $staging/logs/tinytuned ]]; then
    rm -rf "$dest/tinytuned" && cp -r "$staging/logs/tinytuned" "$dest/tinytuned"
    while IFS= read -r -d '' index; do compile_facts "$index" "$index"; done \
        < <(find "$dest/tinytuned" -path '*/compiled/index.json' -print0)
fi
copy logs/tinytuned-test.log tinytuned-test.log
copy logs/timings.tsv timings.tsv
for dir in heads heads-fp32-linears optimizations-off optimizations-on; do  # scripts/checks/section_times.py's outputs
    [[ -d $staging/logs/$dir ]] && rm -rf "${dest:?}/$dir" && cp -r "$staging/logs/$dir" "$dest/$dir"
done
for log in heads-parity heads-parity-fp32-linears optimizations-parity; do copy "logs/$log.log" "$log.log"; done
copy logs/split-build.log split-build.log
copy logs/split-bench.log split-bench.log
copy logs/fresh-box.log fresh-box.log
copy logs/fresh-box.timeline fresh-box.timeline
copy logs/fresh-python-env.txt fresh-python-env.txt
copy logs/cache.md cache.md
copy logs/cache.json cache.json
copy fresh/sam3-bf16-cuda/manifest.json manifest.json
ls -la "$dest"
