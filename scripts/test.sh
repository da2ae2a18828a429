#!/usr/bin/env bash
# Installs paged-kv with its test extra into the active Python environment and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q -e '.[test]'
python -m pytest -q -n 2 --dist loadfile "$@"
