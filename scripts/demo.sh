#!/usr/bin/env bash
# The whole pipeline on the embedded demo profile, through a real Dagster instance in ./dagster_home:
# each stage's job submitted through the code location as the UI's launchpad submits it, so afterwards
# `scripts/ui.sh` shows every run (Jobs, Overview) and materialization. Ends with a summary: each stage's
# seconds and the headline figures beside their expected ranges (docs/demo_figures.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh pipeline  # the test tools (playwright, moto, pytest) are not needed here
source scripts/instance.sh
exec .venv/bin/python scripts/run_pipeline.py --setup-s "$SECONDS" "$@"
