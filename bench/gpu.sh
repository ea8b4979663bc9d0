#!/usr/bin/env bash
# One-GPU benchmark of neuron_parallel's trainer, ready to run on a fresh H200-class machine with
# this repository checked out and python3 (about 3-5 minutes for the default 20 steps):
#
#   bash bench/gpu.sh
#
# It trains a ~1.1 B-parameter Llama (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate
# 8192, vocab 32000; 1.104 B parameters, 1.039 B without the input embedding), built from a config
# on the meta device and randomly initialised (nothing is downloaded), on random tokens, in bf16
# (autocast, fp32 master weights), sequence 2048, SDPA, on one CUDA device, through the training
# entry point the pipeline runs (neuron_parallel.launch.run_torchrun -> torchrun -m
# neuron_parallel.train), then the same model and batches through a plain transformers +
# torch.optim.AdamW loop. It prints:
#   * MFU = tokens/s x FLOPs per token / peak, FLOPs per token = 6 N_non_embedding + 12 L H Q T
#     (the PaLM paper, Chowdhery et al. 2022, appendix B), peak = the hardware catalog's h200 entry (989 TFLOP/s
#     dense bf16, neuron_parallel/planning/hardware.py);
#   * tokens/s of neuron_parallel against the plain loop (ratio);
#   * the planner's predicted peak memory (neuron_parallel/planning/memory.py) against the
#     torch.cuda.max_memory_allocated the training rank reports (train.profile_memory, memory.json).
# Step details are in bench/gpu_bench.py; the figures go to $RESULTS/gpu_<device>_<model>.json.
#
# Settings (environment):
#   DEVICE=cuda    cuda, or cpu for a dry run of every step on a machine without a GPU
#   MODEL=1b       1b, or tiny (a 2-layer model for the dry run)
#   SEQ=2048 MBS=8 STEPS=20 WARMUP=5 HARDWARE=h200   (timed steps = STEPS - WARMUP)
#   PYTHON=python3   the interpreter (the one that holds the machine's torch)
#   WORKDIR=...      where the model, data and runs go (default: a new temporary folder, removed after)
#   RESULTS=$OUT if set, else bench/results
#   WHEELS=DIR       install missing dependencies from the wheels in DIR (no network; --no-deps, so
#                    DIR holds their own missing dependencies too)
#   Dry run on CPU:  DEVICE=cpu MODEL=tiny SEQ=128 MBS=2 STEPS=4 WARMUP=1 bash bench/gpu.sh
#
# Python packages: torch is the machine's own and is never installed here. The project pins
# torch==2.13.0, the CPU wheel on the development machines; `pip install -e .` on a GPU machine
# would fetch the CUDA build of that version in its place. So the project runs from this checkout
# (PYTHONPATH) without being installed, and of its other dependencies only those this benchmark
# imports and cannot find are installed, at the versions pyproject.toml pins, with the installed
# torch held as a constraint so that pip cannot replace it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
export DEVICE=${DEVICE:-cuda}
export RESULTS=${RESULTS:-${OUT:-$ROOT/bench/results}}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export HF_DATASETS_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error

"$PY" -c 'import torch' 2>/dev/null || { echo "error: $PY cannot import torch; set PYTHON to the interpreter that has it" >&2; exit 2; }
"$PY" bench/gpu_bench.py check  # exits 2 with the fix when DEVICE=cuda and no CUDA device is visible

mapfile -t MISSING < <("$PY" bench/gpu_bench.py missing)
if ((${#MISSING[@]})); then
  CONSTRAINT=$(mktemp)
  "$PY" -c 'import torch; print(f"torch=={torch.__version__}")' >"$CONSTRAINT"
  echo "[gpu-bench] installing missing dependencies: ${MISSING[*]} (torch held at $(cat "$CONSTRAINT"))"
  if [[ -n "${WHEELS:-}" ]]; then
    INSTALL=(--no-index --no-deps --find-links "$WHEELS" "$WHEELS"/*.whl)
  else
    INSTALL=("${MISSING[@]}")
  fi
  if ! "$PY" -m pip install -q -c "$CONSTRAINT" "${INSTALL[@]}"; then
    echo "error: pip could not install ${MISSING[*]}; without network access, download their wheels (and those" \
      "of their own missing dependencies) elsewhere and pass WHEELS=DIR" >&2
    exit 2
  fi
  rm -f "$CONSTRAINT"
  STILL=$("$PY" bench/gpu_bench.py missing)
  [[ -z "$STILL" ]] || { echo "error: still missing after the install: $STILL" >&2; exit 2; }
fi

if [[ -n "${WORKDIR:-}" ]]; then
  WORK=$WORKDIR
  mkdir -p "$WORK"
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-bench-XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
fi
START=$SECONDS
for STEP in prepare ours plain report; do
  echo "[gpu-bench] == $STEP ($((SECONDS - START)) s so far)"
  "$PY" bench/gpu_bench.py "$STEP" "$WORK"
done
echo "[gpu-bench] done in $((SECONDS - START)) s"
