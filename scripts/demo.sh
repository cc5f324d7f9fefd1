#!/usr/bin/env bash
# The whole pipeline on the embedded demo profile, through a real Dagster instance
# in ./dagster_home: afterwards `scripts/ui.sh` shows every materialization.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh pipeline  # the test tools (playwright, moto, pytest) are not needed here
source scripts/instance.sh
exec .venv/bin/python scripts/run_pipeline.py "$@"
