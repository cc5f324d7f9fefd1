#!/usr/bin/env bash
# The Dagster UI (webserver + daemon, so the schedule, sensor and run queue work)
# on http://127.0.0.1:3000 for the profile in EAGLE3_PROFILE (default demo).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/dagster ] || scripts/setup.sh
source scripts/instance.sh
exec .venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p "${PORT:-3000}"
