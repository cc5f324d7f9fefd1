#!/usr/bin/env bash
# The Dagster UI (webserver + daemon, so the schedule, sensor and run queue work)
# on http://127.0.0.1:3000 for the profile in EAGLE3_PROFILE (default demo).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/dagster ] || scripts/setup.sh
export DAGSTER_HOME="$PWD/dagster_home"
export EAGLE3_PROFILE="${EAGLE3_PROFILE:-demo}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The queue daemon reads a pool's limit only once it is set; a fresh instance would let the
# first gpu_host runs start together (default_limit applies too late), so set it up front:
# one gpu_host slot per GPU host of the profile (`eagle3 pool-limits`).
.venv/bin/eagle3 pool-limits | while read -r pool limit; do
  .venv/bin/dagster instance concurrency set "$pool" "$limit" >/dev/null
done
.venv/bin/dagster instance concurrency set raw_responses 1 >/dev/null  # one regeneration per log at a time
exec .venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p "${PORT:-3000}"
