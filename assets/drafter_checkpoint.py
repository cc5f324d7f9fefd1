"""`drafter_checkpoint` and `benchmark_report`: the drafter and the number users care about.

Training runs as `torchrun` under Dagster Pipes through the GPU-host resource
(locally in the demo), on `train.nnodes` leased hosts, each in its own process
group, so rank 0's per-step metrics stream into the run and a cancelled run or a
host that fails leaves no worker behind on any host; a retry resumes from the
last checkpoint. The drafter's materialization carries everything needed to
audit it without the disk: target identity, merged_train sha256, hidden-state
version and shards with their checksums, git SHA, package versions and config;
its data version is the sha256 of the exported weights. The report compares
itself with the previous materialization.
"""


import dagster as dg

from assets._common import (
    GPU_POOL, file_version, layout, materialize_result, progress_logger, report_metadata, rounded, table, tag_run,
)
from assets.hidden_states import plan_path_of
from assets.metadata_legend import LEGEND_KEY, legend
from assets.settings import gating_inputs, recorded_settings, stage_settings_metadata
from eagle3_dagster.config import Profile
from eagle3_dagster.stages.bench import BenchSettings
from eagle3_dagster.stages.train import TrainSettings
from resources.upstream import UPSTREAM, Materialized, latest_materialization

GROUP = "drafter"
EXPORT_CHECK = "export_matches_sglang"
# torchrun's worker under Dagster Pipes: the engine's worker with the Pipes reporter (resources/pipes_child.py)
PIPES_WORKER = "resources.pipes_child"


def build(profile: Profile) -> dg.Definitions:
    train_settings, bench_settings = TrainSettings.from_profile(profile), BenchSettings.from_profile(profile)

    @dg.asset(
        name="drafter_checkpoint",
        group_name=GROUP,
        deps=["hidden_states", "vocab_mapping", "target_model"],
        pool=GPU_POOL,
        kinds={"pytorch"},
        required_resource_keys={"gpu_host"},
        ins={"plan": dg.AssetIn("extraction_plan", input_manager_key=UPSTREAM)},
        metadata={**stage_settings_metadata(train_settings),
                  **gating_inputs(extraction_plan="names the shards of the hidden-state version; their content is "
                                  "hidden_states'")},
        check_specs=[dg.AssetCheckSpec(EXPORT_CHECK, asset="drafter_checkpoint", blocking=True,
                                       description="every tensor SGLang's LlamaForCausalLMEagle3 loads is present "
                                       "with its shape, finite, and nothing else; a failing export is named only as "
                                       "refused_export_dir and nothing downstream runs on it")],
        description="EAGLE-3 drafter trained with torchrun (DDP) on the hidden-state shards, exported in the "
        "layout SGLang and vLLM load.",
        retry_policy=dg.RetryPolicy(max_retries=1),
    )
    def drafter_checkpoint(context: dg.AssetExecutionContext, plan: Materialized) -> dg.MaterializeResult:
        from eagle3_dagster.stages.train import finish_training, prepare_training
        from eagle3_dagster.train.nodes import TooFewHostsError, check_host_count, node_commands

        tag_run(context, profile)
        train, gpu_host = train_settings.train, context.resources.gpu_host
        try:
            check_host_count(train.nnodes, len(gpu_host.hosts))
        except TooFewHostsError as e:
            raise dg.Failure(description=str(e)) from None
        # a retry resumes from the run folder's checkpoints: the job (hence the folder) is the same
        launch = prepare_training(train_settings, layout(profile),
                                  plan_path=plan_path_of(plan), worker=PIPES_WORKER)
        with gpu_host.lease_hosts(context, train.nnodes) as hosts:  # one torchrun node per host
            nodes = node_commands(launch.job_path, train, hosts, module=launch.worker)
            for node in nodes:
                context.log.info(f"launching on {node.host.name}: {' '.join(node.argv)}")
            invocation = gpu_host.run_pipes_on_hosts(context=context, commands=nodes, env=launch.env,
                                                     cwd=launch.cwd, name="train")
        child_meta = {}
        for result in invocation.get_results():
            if isinstance(result, dg.MaterializeResult):
                child_meta.update(result.metadata or {})
        report, export_ok, export_detail = finish_training(train_settings, layout(profile), launch)
        meta = {**rounded(child_meta), **report_metadata(report), **provenance_metadata(plan, context),
                **recorded_settings(context)}
        meta[LEGEND_KEY] = legend("drafter_checkpoint", meta)
        check = dg.AssetCheckResult(check_name=EXPORT_CHECK, passed=export_ok, metadata={"detail": export_detail})
        weights = launch.out_dir / "export" / "model.safetensors"
        return dg.MaterializeResult(metadata=meta, check_results=[check],
                                    data_version=dg.DataVersion(file_version(weights)))

    @dg.asset(
        name="benchmark_report",
        group_name=GROUP,
        deps=["drafter_checkpoint", "target_model"],
        pool=GPU_POOL,
        kinds={"markdown"},
        required_resource_keys={"gpu_host"},
        ins={"drafter": dg.AssetIn("drafter_checkpoint", input_manager_key=UPSTREAM)},
        metadata=stage_settings_metadata(bench_settings),
        description="Acceptance length and speed per prompt set and speculative configuration, against no "
        "speculation, the n-gram drafter and the untrained drafter; compared with the previous report.",
    )
    def benchmark_report(context: dg.AssetExecutionContext, drafter: Materialized) -> dg.MaterializeResult:
        from eagle3_dagster.stages.bench import benchmark_stage

        tag_run(context, profile)
        # the report compares itself with its own previous materialization (an asset cannot be its own input)
        previous = latest_materialization(context.instance, context.asset_key).path("results_json")
        export_dir = export_of(drafter)
        with context.resources.gpu_host.lease(context) as host:  # a host of its own while it serves
            report = benchmark_stage(
                bench_settings, layout(profile), export_dir=export_dir, previous_results=previous,
                run_id=context.run_id, gpu_host=host, progress=progress_logger(context),
            )
        results = report.metadata["results_json"]
        report.metadata.update(results_metadata(results))
        return materialize_result(context, report, data_version=file_version(results))

    return dg.Definitions(assets=[drafter_checkpoint, benchmark_report])


def provenance_metadata(plan_materialization: Materialized, context: dg.AssetExecutionContext) -> dict:
    """What produced this drafter, named so that each link can be followed in the instance:
    merged_train's and each shard's data versions, target_model's identity, the code and packages."""
    from eagle3_dagster.hidden.shards import load_manifest
    from eagle3_dagster.provenance import git_sha, package_versions
    from eagle3_dagster.hidden.extraction_plan import load_plan

    plan = load_plan(plan_path_of(plan_materialization))
    manifest = load_manifest(plan.version_dir)
    shards = [{"shard": key, "sha256": e["sha256"], "num_samples": len(e["samples"]), "bytes": e["bytes"]}
              for key, e in sorted(manifest.items())]
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


RESULT_COLUMNS = {  # column → what it means, with its unit
    "set": "prompt set", "method": "proposer (no_spec: plain decoding)", "spec": "num_steps,topk,num_draft_tokens",
    "temperature": "sampling temperature of the decode (0: greedy)",
    "acceptance_length": "tokens per verify step, bonus included",
    "speedup": "median over timing rounds of (tokens/s ÷ no_spec's tokens/s in the same round), on the set",
    "speedup_min": "the lowest round's speed-up", "speedup_max": "the highest round's speed-up",
    "speedup_of_medians": "median tokens/s ÷ no_spec's median tokens/s: the ratio of the two tokens_per_s cells",
    "tokens_per_s": "completion tokens per second, the median over timing rounds",
    "tokens_per_s_min": "the slowest round's tokens/s", "tokens_per_s_max": "the fastest round's tokens/s",
    "num_prompts": "prompts", "completion_tokens": "tokens generated",
}


def results_metadata(results_path) -> dict:
    """Every result row as a table with a schema: the numbers visible on the asset page, not in markdown.
    The headline (which configuration, which band) is the stage's (`bench.report.headline`)."""
    from eagle3_dagster.bench.report import temperature_of
    from eagle3_dagster.storage import read_json

    rows = [r | {"temperature": temperature_of(r)} for r in read_json(results_path)["rows"]]
    return {"results": table([{c: r.get(c) for c in RESULT_COLUMNS} for r in rows], RESULT_COLUMNS)}


def export_of(drafter: Materialized) -> str:
    """The export named by the latest drafter_checkpoint materialization. Only a training run that finished
    and whose export passed `check_export` names one as `export_dir`; a refused export (its check failed) is
    `refused_export_dir` and is never read, nor is an older export behind it."""
    refused = drafter.path("refused_export_dir")
    if refused is not None:
        raise ValueError(f"benchmark_report: the latest drafter_checkpoint export ({refused}) failed its "
                         f"{EXPORT_CHECK} check and is not benchmarked; see the check's detail, then materialize "
                         "drafter_checkpoint again")
    path = drafter.path("export_dir")
    if not path:
        raise FileNotFoundError("benchmark_report: no drafter_checkpoint materialization names an export; "
                                "materialize drafter_checkpoint first")
    return path
