#!/usr/bin/env bash
# The GPU compile gate (scripts/gate/gpu_compile.py) in its own CUDA environment. It writes the
# full report to --out (default results/gpu_compile_report.json, not committed) and its summary
# beside it (gpu_compile_summary.json; results/gpu_compile_summary.json is the committed one).
#
#   bash scripts/gpu_gate.sh [--jax 0.12|0.10] [gpu_compile.py arguments...]
#
# --jax picks the JAX the kernels are compiled with: 0.12 (the default, on Python 3.12) or 0.10
# (the oldest supported, on Python 3.11). The exact versions of each come from
# .ci/constraints-gate-jax<version>.txt; the Python is found by .ci/find_python.sh.
#
# The environment is separate from the test one (which stays CPU-only): jax[cuda12] brings the
# CUDA plugin and ptxas, ~6 GB and ~5 minutes to install. It is kept outside the repository, in
# $PAGED_KV_GPU_ENV or ~/.cache/paged-kv/gpu-env-<hash>, where <hash> is a hash of the
# requirements, the constraints file and the Python version: a later run on the same machine
# reuses it without downloading, and a change of any of them builds a new one. A failed install
# is retried once from scratch; the environment is marked complete only after its imports work.
set -euo pipefail
cd "$(dirname "$0")/.."

JAX_LINE=0.12
if [[ "${1:-}" == "--jax" ]]; then
  JAX_LINE=${2:?--jax needs 0.12 or 0.10}
  shift 2
fi
case "$JAX_LINE" in
  0.12) PY_VERSION=3.12 ;;
  0.10) PY_VERSION=3.11 ;;
  *) echo "gpu_gate: --jax $JAX_LINE is not one of 0.12, 0.10" >&2; exit 2 ;;
esac
CONSTRAINTS=.ci/constraints-gate-jax$JAX_LINE.txt
PY=$(bash .ci/find_python.sh "$PY_VERSION")

# The project's runtime requirements the gate imports, plus the CUDA plugin of the same JAX;
# their versions come from the constraints file. The gate needs neither optax nor tqdm (extras
# now): they stay because this list names the cached environment (a change rebuilds it, ~5
# minutes and ~6 GB); drop them with the next change of the list.
REQUIREMENTS=("jax[cuda12]" jaxlib flax chex optax numpy safetensors tqdm)
HASH=$(cat <(printf '%s\n' "${REQUIREMENTS[@]}" "python=$("$PY" -c 'import sys; print(sys.version)')") "$CONSTRAINTS" \
       | sha256sum | cut -c1-12)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/paged-kv
ENV_DIR=${PAGED_KV_GPU_ENV:-$CACHE/gpu-env-$HASH}

build_env() {
  rm -rf "$ENV_DIR"
  mkdir -p "$(dirname "$ENV_DIR")"
  "$PY" -m venv "$ENV_DIR"
  "$ENV_DIR/bin/python" -m pip install -q --upgrade pip
  "$ENV_DIR/bin/python" -m pip install -q -c "$CONSTRAINTS" "${REQUIREMENTS[@]}"
  # Complete only when the plugin and ptxas are there.
  JAX_PLATFORMS=cpu "$ENV_DIR/bin/python" -c "import jax, jax_plugins.xla_cuda12, flax, chex, optax"
  ls "$ENV_DIR"/lib/python*/site-packages/nvidia/cuda_nvcc/bin/ptxas > /dev/null
  touch "$ENV_DIR/.complete"
}

if [[ ! -f "$ENV_DIR/.complete" ]]; then
  echo "gpu_gate: building the CUDA environment for JAX $JAX_LINE in $ENV_DIR (once per machine and requirements)"
  t0=$(date +%s)
  if ! build_env; then
    echo "gpu_gate: environment install failed; retrying once" >&2
    sleep 5
    build_env
  fi
  echo "gpu_gate: environment ready in $(( $(date +%s) - t0 )) s"
fi

# The repository itself on the path (not installed into the cached environment, so the gate
# always compiles this checkout).
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$ENV_DIR/bin/python" scripts/gate/gpu_compile.py "$@"
