"""`tokenized_dataset[dataset]`: exact token ids and assistant-only loss masks.

Rendered with the target's own tokenizer and chat template; bad records are
quarantined beside the output and counted, and the partition fails when their
share passes `data.bad_fraction_threshold`.
"""


import dagster as dg

from assets._common import file_version, layout, materialize_result, progress_logger, tag_run
from assets.partitions import dataset_partitions
from assets.settings import stage_settings_metadata
from eagle3_dagster.config import Profile
from eagle3_dagster.stages.data import TokenizeSettings

GROUP = "data"


def build(profile: Profile) -> dg.Definitions:
    settings = TokenizeSettings.from_profile(profile)

    @dg.asset(
        name="tokenized_dataset",
        group_name=GROUP,
        partitions_def=dataset_partitions(profile),
        deps=["raw_responses", "target_model"],
        kinds={"json"},
        metadata=stage_settings_metadata(settings),
        description="tokenized_data.jsonl: input_ids + loss_mask (the tokens the target generated), "
        "rendered with the target's chat template; quarantine.jsonl beside it.",
    )
    def tokenized_dataset(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        from eagle3_dagster.stages.data import tokenize_partition

        tag_run(context, profile)
        report = tokenize_partition(settings, context.partition_key, layout(profile),
                                    progress=progress_logger(context))
        return materialize_result(context, report,
                                  data_version=file_version(layout(profile).tokenized(context.partition_key)))

    return dg.Definitions(assets=[tokenized_dataset])
