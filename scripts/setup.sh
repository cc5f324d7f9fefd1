#!/usr/bin/env bash
# Creates .venv and installs the project with its test extras. Every pip call
# passes constraints.txt: on a CPU machine an unpinned torch would pull a
# multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt torch==2.13.0
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev]"
