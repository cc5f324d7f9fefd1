#!/usr/bin/env bash
# Creates .venv and installs the project with the extra named by $1: dev (default: the tests' extras)
# or pipeline (what scripts/demo.sh and scripts/ui.sh need, without the test tools). Every pip call
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
EXTRA=${1:-dev}
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[$EXTRA]"
