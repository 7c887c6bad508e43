#!/usr/bin/env bash
# The Python client's tests (pytest, against a real `k7d daemon`):
#   vmm/python/run-tests.sh [PATH/TO/k7d]
# pytest comes from PyPI into a virtual environment cached outside the
# repository, keyed by its version; nothing is written into the checkout
# (no bytecode, no pytest cache). Needs root (the daemon runs VMs).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PYTEST_VERSION=8.3.4
venv=${K7D_PY_CACHE:-/var/cache/k7d-py}/pytest-$PYTEST_VERSION-py$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# `ready` is written last: an install cut short is made again.
if [ ! -e "$venv/ready" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "pytest==$PYTEST_VERSION"
  touch "$venv/ready"
fi
export K7D_BIN=${1:-${K7D_BIN:-}}
export PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$here/src
cd "$here"
exec "$venv/bin/pytest" -p no:cacheprovider -q tests
