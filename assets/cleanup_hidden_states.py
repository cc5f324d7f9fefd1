"""`cleanup_hidden_states`: the explicit, logged, opt-in deletion of superseded hidden-state versions."""

import dagster as dg

from assets._common import layout, run_tags, tag_run
from eagle3_dagster.config import Profile
from eagle3_dagster.stages.hidden import ShardSettings
from resources.profile import ProfileResource
from resources.upstream import Materialized, upstream_in

CLEANUP_OP = "cleanup_superseded_hidden_states"


class CleanupConfig(dg.Config):
    dry_run: bool = True


@dg.op(
    name=CLEANUP_OP,
    ins={"plan": upstream_in("extraction_plan")},
    description="Delete hidden-state versions other than the current one. Dry run unless dry_run=false.",
)
def cleanup_superseded_hidden_states(
    context: dg.OpExecutionContext, config: CleanupConfig, profile: ProfileResource, plan: Materialized
) -> None:
    from assets.extraction_plan import plan_path_of
    from eagle3_dagster.stages.hidden import cleanup_stage

    loaded = profile.get()
    tag_run(context, loaded)
    report = cleanup_stage(
        ShardSettings.from_profile(loaded),
        layout(loaded),
        dry_run=config.dry_run,
        log=context.log.info,
        plan_path=plan_path_of(plan),
    )
    context.log_event(
        dg.AssetObservation(asset_key="extraction_plan", metadata=report.metadata | {"dry_run": config.dry_run})
    )


@dg.graph
def cleanup_hidden_states():
    cleanup_superseded_hidden_states()


def cleanup_job(profile: Profile) -> dg.JobDefinition:
    """The job, tagged with the profile's run tags."""
    return cleanup_hidden_states.to_job(tags=run_tags(profile))
