"""`target_model`: the verifier every other stage is measured against.

Demo/micro: a materialized asset that builds the tiny DeepSeek-V3 target.
Production: an observed external asset; its data version is the identity of the
model directory on the GPU host (config.json + weight index + its Python files), so
swapping the checkpoint, or editing or adding the code `--trust-remote-code` runs,
marks every downstream asset stale. Both list the code files with their sha256
(`code_files`), what `target.reviewed_code` is written from.
"""


import json

import dagster as dg

from assets._common import accepted, layout, materialize_result, progress_logger, tag_run
from assets.automation import target_observation_condition
from assets.settings import stage_settings_metadata
from eagle3_dagster.config import Profile
from eagle3_dagster.stages.target import ExternalTargetSettings, TinyTargetSettings

GROUP = "target"


def build(profile: Profile) -> dg.Definitions:
    if profile.target.kind == "tiny":
        return dg.Definitions(assets=[_tiny_target_asset(profile)])
    return dg.Definitions(assets=[_external_target_asset(profile)])


def _tiny_target_asset(profile: Profile):
    settings = TinyTargetSettings.from_profile(profile)

    @dg.asset(
        name="target_model",
        group_name=GROUP,
        kinds={"pytorch"},
        metadata=stage_settings_metadata(settings),
        description="The tiny DeepSeek-V3 target (MLA, MoE, first layer dense) pre-trained on ShareGPT, "
        "with a byte-level BPE carrying Kimi's special tokens and chat template.",
    )
    def target_model(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        from eagle3_dagster.stages.target import build_target

        tag_run(context, profile)
        report = build_target(settings, layout(profile), progress=progress_logger(context))
        return materialize_result(context, report)

    return target_model


def _external_target_asset(profile: Profile):
    # Beta in 1.13, and Dagster's way to give an asset built elsewhere a data version that marks its children stale.
    with accepted(dg.BetaWarning, "Function `observable_source_asset` is currently in beta"):
        return _observed_target(profile)


def _observed_target(profile: Profile):
    @dg.observable_source_asset(
        name="target_model",
        group_name=GROUP,
        description=f"The target model directory on the GPU host: {profile.target.path}. "
        "Observed, never built: its data version is the hash of config.json + the weight index + its Python files.",
        required_resource_keys={"gpu_host"},
        metadata=stage_settings_metadata(ExternalTargetSettings.from_profile(profile)),
        # observed by the automation sensor: the shards wait for a first observation (an unobserved source is
        # missing), and a later tick sees a swapped checkpoint
        automation_condition=target_observation_condition(profile.hidden.backfill_cron),
    )
    def target_model(context) -> dg.ObserveResult:
        host = context.resources.gpu_host.host()
        out = host.run([host.spec.python, "-m", "eagle3_dagster.cli", "target-info", str(profile.target.path)],
                       timeout=120).stdout
        info = json.loads(out)
        return dg.ObserveResult(
            data_version=dg.DataVersion(info["identity"]),
            metadata={**{k: v for k, v in info.items() if isinstance(v, (int, float, str))},
                      # the Python that trust_remote_code runs, part of the identity: what target.reviewed_code lists
                      "code_files": dg.MetadataValue.json(info.get("code_files") or {})},
        )

    return target_model
