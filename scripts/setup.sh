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
# fresh venv's ~140 s here), so it installs without (below: lazily, or on every core).
.venv/bin/python -m pip install --quiet --no-compile -c constraints.txt torch==2.13.0 -e ".[$EXTRA]"
# Where Python may write bytecode (PYTHONDONTWRITEBYTECODE unset, as scripts/test.sh runs), each module is
# compiled once where it is first imported, and the ~20,000 files no process imports never are. Where it may
# not, every process would compile what it imports, each time: site-packages is compiled now, again only when
# the installed distributions change (checking 20,000 files' .pyc is ~10 s), and the checkout's own Python too
# (__pycache__ is gitignored; ~0.4 s for the whole engine, in each of the tier's hundreds of processes). Like
# pip, compileall reports the few files some packages ship that are not Python 3 (templates, test data); its
# exit status says only that, so it is not an error here either.
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  INSTALLED=$(ls -d "$SITE"/*.dist-info | sha256sum)
  if [ "$(cat .venv/.eagle3-compiled 2>/dev/null)" != "$INSTALLED" ]; then
    .venv/bin/python -m compileall -q -q -j 0 "$SITE" || true
    echo "$INSTALLED" > .venv/.eagle3-compiled
  fi
  .venv/bin/python -m compileall -q -q -j 0 eagle3_dagster assets resources definitions.py scripts tests || true
fi
