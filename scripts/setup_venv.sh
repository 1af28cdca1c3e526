#!/usr/bin/env bash
# Creates .venv in the repository root and installs hvdlite (editable) with what the
# tests, examples and adapters need. torch is pinned to the 2.13.0 CPU wheel: an
# unpinned torch would pull gigabytes of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,tensorflow]"
