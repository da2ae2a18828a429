#!/usr/bin/env bash
# The GPU compile gate (scripts/gpu_compile.py) in its own CUDA environment.
#
# The environment is separate from the test one (which stays CPU-only): jax[cuda12] brings the
# CUDA plugin and ptxas, ~5.7 GB and ~5 minutes to install. It is kept outside the repository,
# in $PAGED_KV_GPU_ENV or ~/.cache/paged-kv/gpu-env-<hash>, where <hash> is a hash of the
# requirements below: a later run on the same machine reuses it without downloading, and a change
# of the requirements builds a new one. A failed install is retried once from scratch; the
# environment is marked complete only after its imports work.
#
#   bash scripts/gpu_gate.sh [gpu_compile.py arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."

# The project's runtime requirements (pyproject.toml) plus the CUDA plugin of the same JAX.
REQUIREMENTS=(
  "jax[cuda12]==0.10.2"
  "jaxlib==0.10.2"
  "flax==0.12.8"
  "chex==0.1.92"
  "optax==0.2.8"
  "numpy>=1.26"
  "safetensors==0.8.0"
  "tqdm>=4.66"
)
HASH=$(printf '%s\n' "${REQUIREMENTS[@]}" "python=$(python3 -c 'import sys; print(sys.version_info[:2])')" \
       | sha256sum | cut -c1-12)
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/paged-kv
ENV_DIR=${PAGED_KV_GPU_ENV:-$CACHE/gpu-env-$HASH}

build_env() {
  rm -rf "$ENV_DIR"
  mkdir -p "$(dirname "$ENV_DIR")"
  python3 -m venv "$ENV_DIR"
  "$ENV_DIR/bin/python" -m pip install -q --upgrade pip
  "$ENV_DIR/bin/python" -m pip install -q "${REQUIREMENTS[@]}"
  # Complete only when the plugin and ptxas are there.
  JAX_PLATFORMS=cpu "$ENV_DIR/bin/python" -c "import jax, jax_plugins.xla_cuda12, flax, chex, optax"
  ls "$ENV_DIR"/lib/python*/site-packages/nvidia/cuda_nvcc/bin/ptxas > /dev/null
  touch "$ENV_DIR/.complete"
}

if [[ ! -f "$ENV_DIR/.complete" ]]; then
  echo "gpu_gate: building the CUDA environment in $ENV_DIR (once per machine and requirements)"
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
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$ENV_DIR/bin/python" scripts/gpu_compile.py "$@"
