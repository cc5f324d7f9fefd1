#!/usr/bin/env bash
# The whole pipeline on the embedded demo profile, through a real Dagster instance
# in ./dagster_home: afterwards `scripts/ui.sh` shows every materialization.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh pipeline  # the test tools (playwright, moto, pytest) are not needed here
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
exec .venv/bin/python scripts/run_pipeline.py "$@"
