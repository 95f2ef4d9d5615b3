#!/usr/bin/env bash
# Create .venv (once) and install autopar with its test extra into it.
# torch is pinned to the CPU build of 2.13.0 first, so that no multi-GB CUDA wheel is pulled, and
# stays pinned while the rest installs (the test extra brings Hugging Face transformers, about 20 s).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]" "torch==2.13.0"
