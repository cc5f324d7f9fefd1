"""`vocab_mapping`: the draft vocabulary, from the loss-masked token counts of merged_train."""

import dagster as dg

from assets._common import file_version, layout, materialize_result, tag_run
from assets.settings import with_stage_settings
from eagle3_dagster.config import Profile
from eagle3_dagster.stages.data import VocabSettings
from resources.profile import ProfileResource

GROUP = "data"


@dg.asset(
    group_name=GROUP,
    deps=["merged_train", "target_model"],
    kinds={"pytorch"},
    description="Draft vocabulary from loss-masked token counts: d2t (int64 offsets) and t2d (bool mask), safetensors.",
)
def vocab_mapping(context: dg.AssetExecutionContext, profile: ProfileResource) -> dg.MaterializeResult:
    from eagle3_dagster.stages.data import build_vocab

    loaded = profile.get()
    tag_run(context, loaded)
    report = build_vocab(VocabSettings.from_profile(loaded), layout(loaded))
    return materialize_result(context, report, data_version=file_version(layout(loaded).vocab_mapping))


def for_profile(profile: Profile) -> dg.AssetsDefinition:
    return with_stage_settings(vocab_mapping, VocabSettings.from_profile(profile))
