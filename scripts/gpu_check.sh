#!/usr/bin/env bash
# For the day a GPU is lent (one H200, at most 10 minutes in all): the kernels on the GPU against
# the jnp references, the decode step on the stacked scan (layer_matmul) against the per-layer
# unrolled layout at 64 x 4k, every figure the GPU compile gate's performance model estimates
# measured against the estimate (the `perf` stage), and the engine at a Llama 3.1 8B-shaped
# random bf16 model (generate, a ServingEngine run).
# `perf` times each kernel configuration of scripts/gate/perf_plan.perf_specs() (layer_matmul of
# Llama 3.1 8B / 3.2 1B at M 1-256, decode at 64x4k, 256x1k, 1x32k, 4x8k, copy_blocks, XLA's copy
# and GEMM, JAX's pallas.ops.gpu.paged_attention) alone (median/min/max of waited-for calls) and
# 8 times in one program (kernel_us: free of the host's dispatch), and writes, per kernel, the
# measured times next to the model's low/high/roofline from results/gpu_compile_summary.json (null
# where the summary has no estimates yet), the measured fraction of the roofline and
# measured/estimate; decode against JAX's paged attention and copy_blocks against XLA's copy of
# the same bytes (what scripts/bench_kernels.py measured here before); and the layouts stage's
# step times next to the model's sums of that step (so the layouts stage runs first).
# The machine's own JAX is used as it is (0.11 with CUDA 13 when last seen): nothing is installed
# over it. The `env` stage records what ran (results/gpu_env.json) and stops the check when JAX or
# a runtime library is missing or outside the range pyproject.toml declares.
# Writes results/gpu_env.json, results/gpu_kernels_check.json, results/gpu_layouts.json,
# results/gpu_perf_check.json, results/gpu_engine.json (or under $OUT when set: the device tool's
# output folder). Each stage has its own time limit so one slow stage cannot take the others' time
# (env 30 + kernels 120 + layouts 110 + perf 200 + engine 130 = 590 s, under the device tool's
# 600 s per command); `perf` stops starting kernels after 175 s and writes its JSON after each
# one. The exit status is the first failing stage's.
#
#   bash scripts/gpu_check.sh            # uses $PYTHON or python3, which must see the GPU
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-results}
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
timeout 30 "$PY" scripts/gate/gpu_check.py env --out "$DEST/gpu_env.json" || exit 1

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
stage kernels 120 "$PY" scripts/gate/gpu_check.py kernels --out "$DEST/gpu_kernels_check.json"
stage layouts 110 "$PY" scripts/gate/gpu_check.py layouts --batch 64 --context 4096 --out "$DEST/gpu_layouts.json"
stage perf 200 "$PY" scripts/gate/gpu_check.py perf --budget-s 175 --summary results/gpu_compile_summary.json \
  --layouts "$DEST/gpu_layouts.json" --out "$DEST/gpu_perf_check.json"
stage engine 130 "$PY" scripts/gate/gpu_check.py engine --out "$DEST/gpu_engine.json"
exit $status
