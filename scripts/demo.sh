#!/usr/bin/env bash
# Set up, then plan a small GPT for a 2x2 mesh, train it on 4 local ranks and compare with one device.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/autopar demo "$@"
