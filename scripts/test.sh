#!/usr/bin/env bash
# Installs paged-kv with its test extra into the active Python environment, at the exact versions
# CI tests for that Python (.ci/constraints-py<major><minor>.txt: JAX 0.10.2 on 3.11, JAX 0.12 on
# 3.12 and 3.13), and runs the test suite on both cores. Extra arguments go to pytest, e.g.
# `-m smoke` for the fast subset CI runs on the oldest supported pair.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=$(python -c 'import sys; print("%d%d" % sys.version_info[:2])')
CONSTRAINTS=.ci/constraints-py$PYV.txt
if [[ ! -f "$CONSTRAINTS" ]]; then
  echo "scripts/test.sh: no $CONSTRAINTS: paged-kv is tested on Python 3.11 to 3.13 ($(python --version))" >&2
  exit 2
fi
python -m pip install -q --upgrade pip
python -m pip install -q -c "$CONSTRAINTS" -e '.[test]'
python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
