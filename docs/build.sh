#!/usr/bin/env bash
# Builds the HTML docs (API reference + rendered notebooks) into docs/_build/html, with
# warnings as errors. Needs the docs extra: python -m pip install -e ".[docs]"
set -euo pipefail
cd "$(dirname "$0")"
rm -rf _build/html _build/doctrees
python -m sphinx -W --keep-going -b html . _build/html "$@"
echo "docs: $(pwd)/_build/html/index.html"
