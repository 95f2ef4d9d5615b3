#!/usr/bin/env bash
# Set up, check lint and format (ruff), then run the whole test suite (pytest exits non-zero when it
# fails or finds no tests) on two workers, each running whole test files so that a file's
# multi-rank fixtures run once, listing the 15 slowest tests at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=15 "$@"
