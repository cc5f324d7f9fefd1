#!/usr/bin/env bash
# The Dagster UI (webserver + daemon, so the sensors and the run queue work) on http://127.0.0.1:3000
# for the profile in EAGLE3_PROFILE (default demo). Stops, with every process it started, on SIGINT
# (Ctrl-C) or SIGTERM (scripts/dagster_dev.py).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/dagster-webserver ] || scripts/setup.sh pipeline  # what the UI needs, not the test tools
source scripts/instance.sh
exec .venv/bin/python scripts/dagster_dev.py --host 127.0.0.1 --port "${PORT:-3000}"
