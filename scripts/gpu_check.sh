#!/usr/bin/env bash
# For the day a GPU is lent (one H100/H200, about 8 minutes): the kernels on the GPU against the
# jnp references, the kernel benchmark (decode against JAX's pallas.ops.gpu.paged_attention and
# the XLA reference at batch 64 x 4k context; copy_blocks bandwidth against a plain device copy),
# the engine at a Llama 3.1 8B-shaped random bf16 model (generate, a ServingEngine run), and the
# decode step on the stacked scan (layer_matmul) against the per-layer unrolled layout.
# The machine's own JAX is used as it is (0.11 with CUDA 13 when last seen): nothing is installed
# over it. The `env` stage records what ran (results/gpu_env.json) and stops the check when JAX or
# a runtime library is missing or outside the range pyproject.toml declares.
# Writes results/gpu_env.json, results/gpu_kernels_check.json, results/gpu_bench_kernels.json, results/gpu_engine.json
# (or under $OUT when set: the device tool's output folder). Each stage has its own time limit
# so one slow stage cannot take the others' time; the exit status is the first failing stage's.
#
#   bash scripts/gpu_check.sh            # uses $PYTHON or python3, which must see the GPU
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-results}
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
"$PY" scripts/gate/gpu_check.py env --out "$DEST/gpu_env.json" || exit 1

status=0
stage() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "== $name (limit ${secs}s)"
  local t0=$(date +%s)
  timeout "$secs" "$@"
  local rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s"
  [[ $rc -ne 0 && $status -eq 0 ]] && status=$rc
}
stage kernels 150 "$PY" scripts/gate/gpu_check.py kernels --out "$DEST/gpu_kernels_check.json"
stage bench_kernels 120 "$PY" scripts/bench_kernels.py --decode 64:4096 1:4096 256:4096 --out "$DEST/gpu_bench_kernels.json"
stage engine 200 "$PY" scripts/gate/gpu_check.py engine --out "$DEST/gpu_engine.json"
stage layouts 150 "$PY" scripts/gate/gpu_check.py layouts --out "$DEST/gpu_layouts.json"
exit $status
