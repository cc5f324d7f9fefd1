#!/usr/bin/env bash
# The prepared device check for one CUDA GPU with no network (see scripts/gpu_check.py):
# the dump hook under real CUDA streams, hf extraction on CUDA against CPU, torchrun training, and the
# MLA drafter's export drafted on the GPU and served by SGLang where it is installed.
# Prints one table; exit status 0 when every check passes.
#   scripts/gpu_check.sh                 # on the GPU machine (its python3; wheels from .whl/)
#   scripts/gpu_check.sh --device cpu    # the dry run, anywhere
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec "$PYTHON" scripts/gpu_check.py "$@"
