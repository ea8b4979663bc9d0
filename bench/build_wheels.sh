#!/usr/bin/env bash
# The wheels bench/gpu.sh installs on a GPU machine whose image lacks them, built where a package
# index is reachable, for that machine: Python 3.12, manylinux x86_64.
#
#   bash bench/build_wheels.sh [DIR]      (default bench/wheels, which git ignores)
#
# The GPU image this project targets holds torch 2.11 (CUDA 13), transformers 5.17,
# huggingface_hub 1.33, safetensors 0.8, tokenizers 0.23, peft, accelerate, pyarrow and pandas
# (and what those require: numpy, pyyaml, fsspec, filelock, tqdm, packaging, httpx), but not
# `datasets`, which writes and reads the benchmark's token rows (datasets.save_to_disk and
# load_from_disk, as the tokenize step and neuron_parallel.batches do). What it lacks is datasets
# and, of datasets' own requirements, dill, multiprocess and xxhash: those four wheels, at the
# versions .ci/constraints.txt pins, downloaded without their dependencies (--no-deps) and as
# wheels only (--only-binary=:all:), about 1.5 MB. gpu.sh checks there that every dependency
# then imports.
# Settings: PYTHON (the pip to download with, default python3), PYTHON_VERSION (default 3.12).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${1:-$ROOT/bench/wheels}
PY=${PYTHON:-python3}
VERSION=${PYTHON_VERSION:-3.12}
ABI=cp${VERSION//./}
MISSING=(datasets dill multiprocess xxhash)
LIMIT_MIB=64  # what a working tree may carry to the GPU machine, wheels included

PINS=()
for NAME in "${MISSING[@]}"; do
  PIN=$(grep -E "^$NAME==" "$ROOT/.ci/constraints.txt" || true)
  [[ -n $PIN ]] || { echo "error: .ci/constraints.txt pins no version of $NAME; add $NAME==VERSION there" >&2; exit 2; }
  PINS+=("$PIN")
done

mkdir -p "$DIR"
rm -f "$DIR"/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$DIR" \
  --python-version "$VERSION" --implementation cp --abi "$ABI" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  "${PINS[@]}"

COUNT=$(find "$DIR" -maxdepth 1 -name '*.whl' | wc -l)
((COUNT == ${#PINS[@]})) || { echo "error: $COUNT wheels in $DIR for ${#PINS[@]} requirements (${PINS[*]})" >&2; exit 1; }
KIB=$(du -sk "$DIR" | cut -f1)
((KIB <= LIMIT_MIB * 1024)) || { echo "error: $DIR holds $KIB KiB, more than $LIMIT_MIB MiB" >&2; exit 1; }
echo "wheels for Python $VERSION in $DIR ($KIB KiB):"
ls -1 "$DIR"
