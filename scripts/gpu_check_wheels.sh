#!/usr/bin/env bash
# Downloads, into .whl/ (gitignored), the wheels scripts/gpu_check.sh needs on a GPU machine without
# network whose interpreter has torch, transformers, safetensors, numpy, pyyaml, tqdm but not the rest
# of what the engine imports there. Versions are the ones this checkout's .venv runs its tests with.
#   scripts/gpu_check_wheels.sh [PYTHON_VERSION]      # default 3.12 (the GPU machine's interpreter)
#   WHEEL_DIR=/tmp/w311 scripts/gpu_check_wheels.sh 3.11   # elsewhere, e.g. for a dry run on another interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
DISTS="orjson pydantic pydantic-core annotated-types typing-inspection typing-extensions matplotlib contourpy
       cycler fonttools kiwisolver pillow pyparsing python-dateutil six packaging"
pins=$(.venv/bin/python - $DISTS <<'PY'
import importlib.metadata as md, sys
print(" ".join(f"{d}=={md.version(d)}" for d in sys.argv[1:]))
PY
)
mkdir -p "${WHEEL_DIR:-.whl}"
# manylinux2014 (glibc 2.17) wheels load on any current Linux; pure-Python wheels match every platform.
.venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 -d "${WHEEL_DIR:-.whl}" $pins
ls -1 "${WHEEL_DIR:-.whl}"/*.whl | wc -l | xargs echo "wheels in .whl:"
du -sh "${WHEEL_DIR:-.whl}" | cut -f1 | xargs echo "size:"
