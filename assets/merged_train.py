"""`merged_train`: the training corpus.

merged_train streams every tokenized partition (minus the drop list) through a
bounded-memory truncate-and-shuffle; the hidden-state shard partitions are
registered from its metadata by a sensor.
"""

import dagster as dg

from assets._common import layout, materialize_result, progress_logger, tag_run
from assets.settings import with_stage_settings
from eagle3_dagster.config import Profile
from eagle3_dagster.stages.data import MergeSettings
from resources.profile import ProfileResource

GROUP = "data"


@dg.asset(
    group_name=GROUP,
    deps=["tokenized_dataset"],
    kinds={"json"},
    description="merged_train.jsonl: chosen datasets merged, truncated to max_seq_len with loss masks "
    "recomputed, shuffled with the configured seed (same inputs and seed, same bytes).",
)
def merged_train(context: dg.AssetExecutionContext, profile: ProfileResource) -> dg.MaterializeResult:
    from eagle3_dagster.stages.data import merge_partitions

    loaded = profile.get()
    tag_run(context, loaded)
    report = merge_partitions(MergeSettings.from_profile(loaded), layout(loaded), progress=progress_logger(context))
    return materialize_result(context, report)


def for_profile(profile: Profile) -> dg.AssetsDefinition:
    return with_stage_settings(merged_train, MergeSettings.from_profile(profile))
