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
for precision in bf16 fp32; do
    variant=$precision/sam3-$precision-cuda
    copy "$variant/verify/report.md" "verify-$precision.md"
    copy "$variant/verify/report.json" "verify-$precision.json"
    copy "$variant/bench/bench.md" "bench-$precision.md"
    copy "$variant/bench/bench.json" "bench-$precision.json"
    copy "$variant/bench/bench.png" "bench-$precision.png"
    copy "$variant/parity/parity.md" "parity-$precision.md"
    copy "$variant/parity/parity.json" "parity-$precision.json"
    copy "$precision/toolchain/doctor.json" "doctor-$precision.json"
    copy "$precision/toolchain/cuda.env" "cuda-$precision.env"
    copy "$precision/toolkit.txt" "toolkit-$precision.txt"
    copy "$precision/info.txt" "info-$precision.txt"
done
copy bf16fast/sam3-bf16-cuda/verify/report.md verify-bf16fast.md
copy bf16fast/sam3-bf16-cuda/verify/report.json verify-bf16fast.json
copy bf16fast/sam3-bf16-cuda/bench/bench.md bench-bf16fast.md
copy bf16fast/sam3-bf16-cuda/bench/bench.json bench-bf16fast.json
copy tiny/toolchain/doctor.json doctor-tiny.json
copy tiny/tiny-fp32-cuda/verify/report.md verify-tiny.md
copy logs/status steps.txt
copy logs/tiny-chain.log tiny-chain.log
copy logs/tiny-cpp-consumer.log tiny-cpp-consumer.log
copy logs/tiny-gpu-tests.log tiny-gpu-tests.log
copy logs/sdpa-backends.json sdpa-backends.json
copy logs/sdpa-backends.log sdpa-backends.txt
copy nvidia-smi.txt nvidia-smi.txt
ls -la "$dest"
