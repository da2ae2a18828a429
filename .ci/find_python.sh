#!/usr/bin/env bash
# Prints the path of a Python interpreter of the asked minor version (e.g. 3.12), found on this
# machine without a hard-coded path: `pythonX.Y` on PATH if it runs, else the newest pyenv build of
# that version (pyenv's own `latest`, or a look under $PYENV_ROOT/versions). Exit 1 if none.
#
#   PY312=$(bash .ci/find_python.sh 3.12)
set -euo pipefail
want=${1:?usage: find_python.sh X.Y}

runs_as() {  # $1 is an interpreter that runs and reports version $want
  [[ -n "$1" ]] && [[ "$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" == "$want" ]]
}

if cand=$(command -v "python$want" 2>/dev/null) && runs_as "$cand"; then
  # A pyenv shim of an inactive version fails to run, so it is skipped here; resolve it to a file.
  "$cand" -c 'import sys; print(sys.executable)'
  exit 0
fi
root=${PYENV_ROOT:-$HOME/.pyenv}
if command -v pyenv >/dev/null 2>&1; then
  if ver=$(pyenv latest "$want" 2>/dev/null) && cand="$(pyenv root)/versions/$ver/bin/python$want" && runs_as "$cand"; then
    echo "$cand"
    exit 0
  fi
  root=$(pyenv root)
fi
for cand in $(ls -d "$root"/versions/"$want".*/bin/python"$want" 2>/dev/null | sort -V -r); do
  if runs_as "$cand"; then
    echo "$cand"
    exit 0
  fi
done
echo "find_python: no Python $want here (looked for python$want on PATH and under $root/versions)" >&2
exit 1
