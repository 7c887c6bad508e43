#!/usr/bin/env bash
# The Python client's tests (pytest, against a real `k7d daemon`):
#   vmm/python/run-tests.sh [PATH/TO/k7d]
# pytest and Ray (the two-node rollout test, tests/test_ray_rollouts.py)
# come from PyPI into a virtual environment cached outside the repository,
# keyed by their versions; nothing is written into the checkout (no
# bytecode, no pytest cache). Needs root (the daemons run VMs).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PYTEST_VERSION=8.3.4
RAY_VERSION=2.60.0
venv=${K7D_PY_CACHE:-/var/cache/k7d-py}/pytest-$PYTEST_VERSION-ray-$RAY_VERSION-py$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# `ready` is written last: an install cut short is made again.
if [ ! -e "$venv/ready" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet "pytest==$PYTEST_VERSION" "ray==$RAY_VERSION"
  touch "$venv/ready"
fi
# Ray reports nothing home, and keeps its session files outside the checkout.
export RAY_USAGE_STATS_ENABLED=0
export K7D_BIN=${1:-${K7D_BIN:-}}
export PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$here/src
cd "$here"
exec "$venv/bin/pytest" -p no:cacheprovider -q tests
