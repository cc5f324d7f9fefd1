"""`merged_train` and `vocab_mapping`: the training corpus and the draft vocabulary.

merged_train streams every tokenized partition (minus the drop list) through a
bounded-memory truncate-and-shuffle; the hidden-state shard partitions are
registered from its metadata by a sensor.
"""


import dagster as dg

from assets._common import file_version, layout, materialize_result, progress_logger, tag_run
from assets.settings import stage_settings_metadata
from eagle3_dagster.config import Profile
from eagle3_dagster.stages.data import MergeSettings, VocabSettings

GROUP = "data"


def build(profile: Profile) -> dg.Definitions:
    merge_settings, vocab_settings = MergeSettings.from_profile(profile), VocabSettings.from_profile(profile)

    @dg.asset(
        name="merged_train",
        group_name=GROUP,
        deps=["tokenized_dataset"],
        kinds={"json"},
        metadata=stage_settings_metadata(merge_settings),
        description="merged_train.jsonl: chosen datasets merged, truncated to max_seq_len with loss masks "
        "recomputed, shuffled with the configured seed (same inputs and seed, same bytes).",
    )
    def merged_train(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        from eagle3_dagster.stages.data import merge_partitions

        tag_run(context, profile)
        report = merge_partitions(merge_settings, layout(profile), progress=progress_logger(context))
        return materialize_result(context, report)

    @dg.asset(
        name="vocab_mapping",
        group_name=GROUP,
        deps=["merged_train", "target_model"],
        kinds={"pytorch"},
        metadata=stage_settings_metadata(vocab_settings),
        description="Draft vocabulary from loss-masked token counts: d2t (int64 offsets) and t2d (bool mask), "
        "safetensors.",
    )
    def vocab_mapping(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        from eagle3_dagster.stages.data import build_vocab

        tag_run(context, profile)
        report = build_vocab(vocab_settings, layout(profile))
        return materialize_result(context, report, data_version=file_version(layout(profile).vocab_mapping))

    return dg.Definitions(assets=[merged_train, vocab_mapping])
