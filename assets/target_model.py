"""`target_model`: the verifier every other stage is measured against.

Demo/micro: a materialized asset that builds the tiny DeepSeek-V3 target (`target_model`).
Production: an observed external asset (`observed_target_model`, the same key); its data version is the
identity of the model directory on the GPU host (config.json + weight index + its Python files), so
swapping the checkpoint, or editing or adding the code `--trust-remote-code` runs,
marks every downstream asset stale. Both list the code files with their sha256
(`code_files`), what `target.reviewed_code` is written from. `for_profile` picks the one the profile's
`target.kind` names.
"""

import json

import dagster as dg

from assets._common import layout, materialize_result, progress_logger, silenced_warnings, tag_run
from assets.automation import target_observation_condition
from assets.settings import with_stage_settings
from eagle3_dagster.config import Profile
from eagle3_dagster.stages.target import ExternalTargetSettings, TinyTargetSettings
from resources.profile import ProfileResource

GROUP = "target"


@dg.asset(
    group_name=GROUP,
    kinds={"pytorch"},
    description="The tiny DeepSeek-V3 target (MLA, MoE, first layer dense) pre-trained on ShareGPT, "
    "with a byte-level BPE carrying Kimi's special tokens and chat template.",
)
def target_model(context: dg.AssetExecutionContext, profile: ProfileResource) -> dg.MaterializeResult:
    from eagle3_dagster.stages.target import build_target

    loaded = profile.get()
    tag_run(context, loaded)
    report = build_target(TinyTargetSettings.from_profile(loaded), layout(loaded), progress=progress_logger(context))
    return materialize_result(context, report)


# Beta in 1.13, and Dagster's way to give an asset built elsewhere a data version that marks its children stale.
with silenced_warnings(dg.BetaWarning, "Function `multi_observable_source_asset` is currently in beta"):

    @dg.multi_observable_source_asset(
        specs=[dg.AssetSpec("target_model", group_name=GROUP)],
        required_resource_keys={"gpu_host", "profile"},
    )
    def observed_target_model(context):
        path = context.resources.profile.get().target.path
        host = context.resources.gpu_host.host()
        out = host.run([host.spec.python, "-m", "eagle3_dagster.cli", "target-info", str(path)], timeout=120).stdout
        info = json.loads(out)
        yield dg.ObserveResult(
            asset_key="target_model",
            data_version=dg.DataVersion(info["identity"]),
            metadata={
                **{k: v for k, v in info.items() if isinstance(v, (int, float, str))},
                # the Python that trust_remote_code runs, part of the identity: what target.reviewed_code lists
                "code_files": dg.MetadataValue.json(info.get("code_files") or {}),
            },
        )


def for_profile(profile: Profile) -> dg.AssetsDefinition:
    """The target the profile names: built (tiny) or observed on the GPU host (external)."""
    if profile.target.kind == "tiny":
        return with_stage_settings(target_model, TinyTargetSettings.from_profile(profile))
    return with_stage_settings(
        observed_target_model,
        ExternalTargetSettings.from_profile(profile),
        description=f"The target model directory on the GPU host: {profile.target.path}. Observed, never built: "
        "its data version is the hash of config.json + the weight index + its Python files.",
        # observed by the automation sensor: the shards wait for a first observation (an unobserved source is
        # missing), and a later tick sees a swapped checkpoint
        automation_condition=target_observation_condition(profile.hidden.backfill_cron),
    )
