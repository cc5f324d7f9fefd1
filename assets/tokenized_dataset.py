"""`tokenized_dataset[dataset]`: exact token ids and assistant-only loss masks.

Rendered with the target's own tokenizer and chat template; bad records are
quarantined beside the output and counted, and the partition fails when their
share passes `data.bad_fraction_threshold`.
"""

import dagster as dg

from assets._common import file_version, layout, materialize_result, progress_logger, tag_run
from assets.partitions import dataset_partitions
from assets.settings import with_stage_settings
from eagle3_dagster.config import Profile
from eagle3_dagster.stages.data import TokenizeSettings
from resources.profile import ProfileResource

GROUP = "data"


@dg.asset(
    group_name=GROUP,
    deps=["raw_responses", "target_model"],
    kinds={"json"},
    description="tokenized_data.jsonl: input_ids + loss_mask (the tokens the target generated), "
    "rendered with the target's chat template; quarantine.jsonl beside it.\n\n"
    "Which datasets are stale, missing or failed: the check `partitions_current` and its table `not_current`.",
)
def tokenized_dataset(context: dg.AssetExecutionContext, profile: ProfileResource) -> dg.MaterializeResult:
    from eagle3_dagster.stages.data import tokenize_partition

    loaded = profile.get()
    tag_run(context, loaded)
    name = context.partition_key
    report = tokenize_partition(
        TokenizeSettings.from_profile(loaded), name, layout(loaded), progress=progress_logger(context)
    )
    return materialize_result(context, report, data_version=file_version(layout(loaded).tokenized(name)))


def for_profile(profile: Profile) -> dg.AssetsDefinition:
    """One partition per dataset of the profile."""
    return with_stage_settings(
        tokenized_dataset, TokenizeSettings.from_profile(profile), partitions_def=dataset_partitions(profile)
    )
