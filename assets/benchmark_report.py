"""`benchmark_report`: acceptance length and speed of the drafter drafter_checkpoint exported.

Served by SGLang on a GPU host, or the in-process speculative-decoding simulator on CPU profiles; the
export comes from drafter_checkpoint's latest materialization (an input), never a refused one. The report
compares itself with its own previous materialization.
"""

import dagster as dg

from assets._common import GPU_POOL, file_version, layout, materialize_result, progress_logger, table, tag_run
from assets.drafter_checkpoint import EXPORT_CHECK
from assets.settings import with_stage_settings
from eagle3_dagster.config import Profile
from eagle3_dagster.stages.bench import BenchSettings
from resources.gpu_host import GpuHostResource
from resources.profile import ProfileResource
from resources.upstream import UPSTREAM, Materialized, latest_materialization

GROUP = "drafter"


@dg.asset(
    group_name=GROUP,
    deps=["target_model"],
    pool=GPU_POOL,
    kinds={"markdown"},
    ins={"drafter": dg.AssetIn("drafter_checkpoint", input_manager_key=UPSTREAM)},
    description="Acceptance length and speed per prompt set and speculative configuration, against no "
    "speculation, the n-gram drafter and the untrained drafter; compared with the previous report.",
)
def benchmark_report(
    context: dg.AssetExecutionContext, profile: ProfileResource, gpu_host: GpuHostResource, drafter: Materialized
) -> dg.MaterializeResult:
    from eagle3_dagster.stages.bench import benchmark_stage

    loaded = profile.get()
    tag_run(context, loaded)
    # the report compares itself with its own previous materialization (an asset cannot be its own input)
    previous = latest_materialization(context.instance, context.asset_key).path("results_json")
    export_dir = export_of(drafter)
    with gpu_host.lease(context) as host:  # a host of its own while it serves
        report = benchmark_stage(
            BenchSettings.from_profile(loaded),
            layout(loaded),
            export_dir=export_dir,
            previous_results=previous,
            run_id=context.run_id,
            gpu_host=host,
            progress=progress_logger(context),
        )
    results = report.metadata["results_json"]
    report.metadata.update(results_metadata(results))
    return materialize_result(context, report, data_version=file_version(results))


def for_profile(profile: Profile) -> dg.AssetsDefinition:
    return with_stage_settings(benchmark_report, BenchSettings.from_profile(profile))


RESULT_COLUMNS = {  # column → what it means, with its unit
    "set": "prompt set",
    "method": "proposer (no_spec: plain decoding)",
    "spec": "num_steps,topk,num_draft_tokens",
    "temperature": "sampling temperature of the decode (0: greedy)",
    "acceptance_length": "tokens per verify step, bonus included",
    "speedup": "median over timing rounds of (tokens/s ÷ no_spec's tokens/s in the same round), on the set",
    "speedup_min": "the lowest round's speed-up",
    "speedup_max": "the highest round's speed-up",
    "speedup_of_medians": "median tokens/s ÷ no_spec's median tokens/s: the ratio of the two tokens_per_s cells",
    "tokens_per_s": "completion tokens per second, the median over timing rounds",
    "tokens_per_s_min": "the slowest round's tokens/s",
    "tokens_per_s_max": "the fastest round's tokens/s",
    "num_prompts": "prompts",
    "completion_tokens": "tokens generated",
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
        raise ValueError(
            f"benchmark_report: the latest drafter_checkpoint export ({refused}) failed its "
            f"{EXPORT_CHECK} check and is not benchmarked; see the check's detail, then materialize "
            "drafter_checkpoint again"
        )
    path = drafter.path("export_dir")
    if not path:
        raise FileNotFoundError(
            "benchmark_report: no drafter_checkpoint materialization names an export; "
            "materialize drafter_checkpoint first"
        )
    return path
