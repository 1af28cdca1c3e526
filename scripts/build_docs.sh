#!/usr/bin/env bash
# Builds the documentation site (docs/, mkdocs.yml) into build/site, failing on any
# warning (mkdocs --strict). Installs MkDocs, Material and mkdocstrings into the
# repository's .venv (made by scripts/setup_venv.sh). The API reference, the
# environment-variable table and the launcher's options are generated from this
# checkout's code, which is put first on the import path.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "build_docs.sh: no .venv here; run: bash scripts/setup_venv.sh" >&2
  exit 1
fi
.venv/bin/python -m pip install -q "mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10" \
    "mkdocstrings[python]>=0.26" "pymdown-extensions>=10"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# mkdocs-material 9.7+ prints a banner about MkDocs 2.0 on every build.
export NO_MKDOCS_2_WARNING=1 TF_CPP_MIN_LOG_LEVEL=3
.venv/bin/python -m mkdocs build --strict "$@"
echo "build_docs.sh: site in build/site (open build/site/index.html)"
