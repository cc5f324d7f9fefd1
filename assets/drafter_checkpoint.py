"""`drafter_checkpoint`: the EAGLE-3 drafter, trained and exported.

Training runs as `torchrun` under Dagster Pipes through the GPU-host resource
(locally in the demo), on `train.nnodes` leased hosts, each in its own process
group, so rank 0's per-step metrics stream into the run and a cancelled run or a
host that fails leaves no worker behind on any host; a retry resumes from the
last checkpoint. The shards it trains on are those of the plan extraction_plan wrote (an input). The drafter's
materialization carries everything needed to audit it without the disk: target identity, merged_train sha256,
hidden-state version and shards with their checksums, git SHA, package versions and config; its data version
is the sha256 of the exported weights.
"""

import dagster as dg

from assets._common import GPU_POOL, file_version, layout, report_metadata, rounded, table, tag_run
from assets.extraction_plan import plan_path_of
from assets.metadata_legend import LEGEND_KEY, legend
from assets.settings import gating_inputs, recorded_settings, with_stage_settings
from eagle3_dagster.config import Profile
from eagle3_dagster.stages.train import TrainSettings
from resources.gpu_host import GpuHostResource
from resources.profile import ProfileResource
from resources.upstream import UPSTREAM, Materialized

GROUP = "drafter"
EXPORT_CHECK = "export_matches_sglang"
# torchrun's worker under Dagster Pipes: the engine's worker with the Pipes reporter (resources/pipes_child.py)
PIPES_WORKER = "resources.pipes_child"


@dg.asset(
    group_name=GROUP,
    deps=["hidden_states", "vocab_mapping", "target_model"],
    pool=GPU_POOL,
    kinds={"pytorch"},
    ins={"plan": dg.AssetIn("extraction_plan", input_manager_key=UPSTREAM)},
    metadata=gating_inputs(
        extraction_plan="names the shards of the hidden-state version; their content is hidden_states'"
    ),
    check_specs=[
        dg.AssetCheckSpec(
            EXPORT_CHECK,
            asset="drafter_checkpoint",
            blocking=True,
            description="every tensor SGLang's LlamaForCausalLMEagle3 loads is present "
            "with its shape, finite, and nothing else; a failing export is named only as "
            "refused_export_dir and nothing downstream runs on it",
        )
    ],
    description="EAGLE-3 drafter trained with torchrun (DDP) on the hidden-state shards, exported in the "
    "layout SGLang and vLLM load.",
    retry_policy=dg.RetryPolicy(max_retries=1),
)
def drafter_checkpoint(
    context: dg.AssetExecutionContext, profile: ProfileResource, gpu_host: GpuHostResource, plan: Materialized
) -> dg.MaterializeResult:
    from eagle3_dagster.stages.train import finish_training, prepare_training
    from eagle3_dagster.train.nodes import TooFewHostsError, check_host_count, node_commands

    loaded = profile.get()
    settings = TrainSettings.from_profile(loaded)
    tag_run(context, loaded)
    train = settings.train
    try:
        check_host_count(train.nnodes, len(gpu_host.hosts))
    except TooFewHostsError as e:
        raise dg.Failure(description=str(e)) from None
    # a retry resumes from the run folder's checkpoints: the job (hence the folder) is the same
    launch = prepare_training(settings, layout(loaded), plan_path=plan_path_of(plan), worker=PIPES_WORKER)
    with gpu_host.lease_hosts(context, train.nnodes) as hosts:  # one torchrun node per host
        nodes = node_commands(launch.job_path, train, hosts, module=launch.worker)
        for node in nodes:
            context.log.info(f"launching on {node.host.name}: {' '.join(node.argv)}")
        invocation = gpu_host.run_pipes_on_hosts(
            context=context, commands=nodes, env=launch.env, cwd=launch.cwd, name="train"
        )
    child_meta = {}
    for result in invocation.get_results():
        if isinstance(result, dg.MaterializeResult):
            child_meta.update(result.metadata or {})
    report, export_ok, export_detail = finish_training(settings, layout(loaded), launch)
    meta = {
        **rounded(child_meta),
        **report_metadata(report),
        **provenance_metadata(plan, context),
        **recorded_settings(context),
    }
    meta[LEGEND_KEY] = legend("drafter_checkpoint", meta)
    check = dg.AssetCheckResult(check_name=EXPORT_CHECK, passed=export_ok, metadata={"detail": export_detail})
    weights = launch.out_dir / "export" / "model.safetensors"
    return dg.MaterializeResult(
        metadata=meta, check_results=[check], data_version=dg.DataVersion(file_version(weights))
    )


def for_profile(profile: Profile) -> dg.AssetsDefinition:
    return with_stage_settings(drafter_checkpoint, TrainSettings.from_profile(profile))


def provenance_metadata(plan_materialization: Materialized, context: dg.AssetExecutionContext) -> dict:
    """What produced this drafter, named so that each link can be followed in the instance:
    merged_train's and each shard's data versions, target_model's identity, the code and packages."""
    from eagle3_dagster.hidden.shards import load_manifest
    from eagle3_dagster.provenance import git_sha, package_versions
    from eagle3_dagster.hidden.extraction_plan import load_plan

    plan = load_plan(plan_path_of(plan_materialization))
    manifest = load_manifest(plan.version_dir)
    shards = [
        {"shard": key, "sha256": e["sha256"], "num_samples": len(e["samples"]), "bytes": e["bytes"]}
        for key, e in sorted(manifest.items())
    ]
    return {
        "target_identity": plan.target.identity,
        "merged_train_sha256": plan.merged_train_sha256,
        "hidden_version": plan.version,
        "num_shards": len(shards),
        "shards": table(shards, {"sha256": "the shard's data version (hidden_states partition)"}),
        "git_sha": git_sha(),
        "code_version": context.assets_def.code_versions_by_key[context.asset_key],
        "packages": dg.MetadataValue.json(package_versions()),
    }
