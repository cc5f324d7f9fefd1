# Sourced by scripts/demo.sh and scripts/ui.sh from the repository root, once .venv exists: the local
# Dagster instance in ./dagster_home for the profile in EAGLE3_PROFILE (default demo), with its pool limits.
# EAGLE3_DAGSTER_HOME names another instance folder holding a dagster.yaml (the tests' own instances);
# a DAGSTER_HOME set for other projects is not used.
export DAGSTER_HOME="${EAGLE3_DAGSTER_HOME:-$PWD/dagster_home}"
if [ ! -f "$DAGSTER_HOME/dagster.yaml" ]; then
  echo "no dagster.yaml in $DAGSTER_HOME (copy dagster_home/dagster.yaml there)" >&2
  exit 1
fi
export EAGLE3_PROFILE="${EAGLE3_PROFILE:-demo}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The queue daemon reads a pool's limit only once it is set; a fresh instance would let the
# first gpu_host runs start together (default_limit applies too late), so set it up front:
# one gpu_host slot per GPU host of the profile (`eagle3 pool-limits`).
.venv/bin/eagle3 pool-limits | while read -r pool limit; do
  .venv/bin/dagster instance concurrency set "$pool" "$limit" >/dev/null
done
.venv/bin/dagster instance concurrency set raw_responses 1 >/dev/null  # one regeneration per log at a time
