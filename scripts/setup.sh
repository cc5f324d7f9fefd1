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
EXTRA=${1:-dev}
# One resolve for torch and the project. pip byte-compiles what it installs one file after another (~90 s of a
# fresh venv's ~140 s here): installed without, site-packages is compiled on every core instead, the same .pyc
# files in half the time. Like pip, compileall reports the few files some packages ship that are not Python 3
# (templates, test data); its exit status says only that, so it is not an error here either.
.venv/bin/python -m pip install --quiet --no-compile -c constraints.txt torch==2.13.0 -e ".[$EXTRA]"
# Compiled again only when the installed distributions change (checking 20,000 files' .pyc is ~10 s).
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
INSTALLED=$(ls -d "$SITE"/*.dist-info | sha256sum)
if [ "$(cat .venv/.eagle3-compiled 2>/dev/null)" != "$INSTALLED" ]; then
  .venv/bin/python -m compileall -q -q -j 0 "$SITE" || true
  echo "$INSTALLED" > .venv/.eagle3-compiled
fi
# The checkout's own Python as well (__pycache__ is gitignored): where PYTHONDONTWRITEBYTECODE is set, every
# process (run workers, step processes, drivers, CLI calls: hundreds in the test tier) would otherwise compile
# the project's modules it imports, each time (~0.4 s for the whole engine). An edited file is compiled again
# where it is imported, as usual.
.venv/bin/python -m compileall -q -q -j 0 eagle3_dagster assets resources definitions.py scripts tests || true
