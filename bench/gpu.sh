#!/usr/bin/env bash
# One-GPU benchmark of neuron_parallel's trainer, ready to run on a GPU machine as it is, with this
# repository checked out, no network and no package installed beforehand (about 4-6 minutes for
# the default 20 steps; everything ends within TIME_LIMIT_S):
#
#   bash bench/gpu.sh
#
# It trains a ~1.1 B-parameter Llama (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate
# 8192, vocab 32000; 1.104 B parameters, 1.039 B without the input embedding), built from a config
# on the meta device and randomly initialised (nothing is downloaded), on random tokens, in bf16
# (autocast, fp32 master weights), sequence 2048, SDPA, on one CUDA device, through the training
# entry point the pipeline runs (neuron_parallel.launch.run_torchrun -> torchrun -m
# neuron_parallel.train), then the same model and batches through a plain transformers +
# torch.optim.AdamW loop. It prints, and writes to one JSON file:
#   * MFU = tokens/s x FLOPs per token / peak, FLOPs per token = 6 N_non_embedding + 12 L H Q T
#     (the PaLM paper, Chowdhery et al. 2022, appendix B), against two peaks: the hardware
#     catalog's h200 entry (989 TFLOP/s dense bf16, neuron_parallel/planning/hardware.py) and a
#     bf16 8192^3 matmul measured in the same run (CUDA events);
#   * tokens/s of neuron_parallel against the plain loop (ratio), both timed the same way: the
#     device synchronized every log step (the greatest common divisor of WARMUP and STEPS), the
#     time shared over the steps between, the losses read after the time is taken;
#   * the planner's predicted peak memory (neuron_parallel/planning/memory.py) against the
#     torch.cuda.max_memory_allocated the training rank reports (train.profile_memory, memory.json);
#   * host syncs per training step: the trainer's steps with torch.cuda.set_sync_debug_mode("warn"),
#     each synchronizing call counted with where it was made;
#   * attention over rows packed from 4 documents, at the benchmark's sequence and heads: the
#     trainer's path (compiled FlexAttention with a document block mask on CUDA) against SDPA with
#     the explicit mask, time and peak memory of forward and forward + backward, and the parity of
#     outputs and gradients (with each against an fp32 reference);
#   * the losses of 3 steps of the trainer in bf16 against fp32 (TF32 off).
# Step details are in bench/gpu_bench.py and bench/gpu_probes.py; the figures go to
# $RESULTS/gpu_<device>_<model>.json. A step that fails or runs out of time leaves the others'
# figures; the report lists what is missing, and the script then exits 1.
#
# Settings (environment):
#   DEVICE=cuda    cuda, or cpu for a dry run of every step on a machine without a GPU (what has no
#                  CPU counterpart, such as the sync debug mode, says "not applicable")
#   MODEL=1b       1b, or tiny (a 2-layer model for the dry run)
#   SEQ=2048 MBS=8 STEPS=20 WARMUP=5 HARDWARE=h200   (timed steps = STEPS - WARMUP)
#   PYTHON=python3   the interpreter (the one that holds the machine's torch)
#   WORKDIR=...      where the model, data, runs and installed wheels go (default: a new temporary
#                    folder, removed after)
#   RESULTS=$OUT if set, else bench/results
#   WHEELS=bench/wheels   wheels of the dependencies a GPU image lacks (bash bench/build_wheels.sh
#                    makes them where a package index is reachable); used when the folder holds any
#   TIME_LIMIT_S=470 the whole run's limit: each step gets what is left (less 30 s for the report)
#   Dry run on CPU:  DEVICE=cpu MODEL=tiny SEQ=128 MBS=2 STEPS=4 WARMUP=1 bash bench/gpu.sh
#
# Python packages: torch is the machine's own and is never installed here; the project runs from
# this checkout (PYTHONPATH) without being installed. Of its dependencies, those this benchmark
# imports and cannot find are installed from WHEELS, with no index and no dependencies, into a
# folder of the work directory put on PYTHONPATH (nothing of the machine's Python changes), torch
# held at its installed version; without wheels, pip fetches them at the versions
# .ci/constraints.txt pins, torch held. Then every dependency must import.
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

if [[ -n "${WORKDIR:-}" ]]; then
  WORK=$(mkdir -p "$WORKDIR" && cd "$WORKDIR" && pwd)
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-bench-XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
fi
export HF_HOME=${HF_HOME:-$WORK/hf-home}  # nothing written outside the work directory

WHEELS=${WHEELS:-$ROOT/bench/wheels}
mapfile -t MISSING < <("$PY" bench/gpu_bench.py missing)
if ((${#MISSING[@]})); then
  CONSTRAINT=$WORK/torch-held.txt
  "$PY" -c 'import torch; print(f"torch=={torch.__version__}")' >"$CONSTRAINT"
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    DEPS=$WORK/site-packages
    mkdir -p "$DEPS"
    export PYTHONPATH="$PYTHONPATH:$DEPS"
    mapfile -t FILES < <("$PY" bench/gpu_bench.py wheels "$WHEELS")
    echo "[gpu-bench] missing ${MISSING[*]}: installing ${FILES[*]##*/} from $WHEELS into $DEPS (no index, no" \
      "dependencies, $(cat "$CONSTRAINT") held)"
    if ((${#FILES[@]})); then
      if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --target "$DEPS" -c "$CONSTRAINT" "${FILES[@]}" ||
          { echo "error: pip could not install the wheels of $WHEELS; rebuild them for this Python with" \
            "PYTHON_VERSION=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') bash bench/build_wheels.sh" >&2; exit 2; }
      else  # no pip: a wheel is a zip archive of its files as installed
        for WHEEL in "${FILES[@]}"; do "$PY" -m zipfile -e "$WHEEL" "$DEPS"; done
      fi
    fi
  else
    echo "[gpu-bench] installing missing dependencies: ${MISSING[*]} ($(cat "$CONSTRAINT") held)"
    if ! "$PY" -m pip install -q -c "$CONSTRAINT" "${MISSING[@]}"; then
      echo "error: pip could not install ${MISSING[*]}; without network access, build their wheels where a" \
        "package index is reachable (bash bench/build_wheels.sh) and bring bench/wheels along, or pass WHEELS=DIR" >&2
      exit 2
    fi
  fi
fi
"$PY" bench/gpu_bench.py imports  # exits 2 naming a dependency that does not import

LIMIT=${TIME_LIMIT_S:-470}
RESERVE=30  # kept for the report
FAILED=()
for STEP in prepare ours plain kernels rank report; do
  if [[ $STEP == report ]]; then
    LEFT=$((LIMIT - SECONDS > RESERVE ? LIMIT - SECONDS : RESERVE))
  else
    LEFT=$((LIMIT - SECONDS - RESERVE))
  fi
  if ((LEFT < 10)); then
    echo "[gpu-bench] == $STEP skipped: TIME_LIMIT_S=$LIMIT is spent"
    FAILED+=("$STEP (no time left)")
    continue
  fi
  echo "[gpu-bench] == $STEP ($SECONDS s so far; at most $LEFT s)"
  CODE=0
  # SIGINT on time out: the step's Python ends its torchrun (KeyboardInterrupt), then KILL 20 s later.
  timeout --foreground -s INT -k 20 "$LEFT" "$PY" bench/gpu_bench.py "$STEP" "$WORK" || CODE=$?
  if ((CODE == 124)); then
    FAILED+=("$STEP (out of time)")
  elif ((CODE)); then
    FAILED+=("$STEP (exit $CODE)")
  fi
  if ((CODE)) && [[ $STEP == prepare ]]; then
    break  # every other step needs its model and data
  fi
done
echo "[gpu-bench] done in $SECONDS s"
if ((${#FAILED[@]})); then
  echo "[gpu-bench] steps that did not finish: ${FAILED[*]}" >&2
  exit 1
fi
