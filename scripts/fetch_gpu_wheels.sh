#!/usr/bin/env bash
# Download, into .whl/, the wheels scripts/gpu_run.sh installs on a GPU machine without a registry:
# the versions uv.lock pins for what that machine's image lacks or has in another version.
set -euo pipefail
cd "$(dirname "$0")/.."
pinned() { awk -v n="$1" '$0 == "name = \"" n "\"" {getline; gsub(/version = |"/, ""); print; exit}' uv.lock; }
mkdir -p .whl
for name in transformers doit open-clip-torch regex; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$name==$(pinned "$name")"
done
ls -la .whl
