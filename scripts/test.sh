#!/usr/bin/env bash
# Installs into .venv (scripts/setup_venv.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
HVDLITE_REQUIRE_NATIVE=1 OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
