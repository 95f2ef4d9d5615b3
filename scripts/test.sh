#!/usr/bin/env bash
# Set up, then run the whole test suite (pytest exits non-zero when it fails or finds no tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
