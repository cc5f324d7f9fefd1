"""The one Definitions object of the eagle3_dagster code location.

The assets are module-level functions, one module per asset in `assets/`, named as the asset. The profile is
chosen by EAGLE3_PROFILE (default: demo) when Dagster loads this file; it reaches the assets once, as the
`profile` resource, and `build_definitions` applies what it decides at definition time (dataset partitions,
code versions from the settings each stage is given, the shard automation). `build_definitions` takes a
profile explicitly so tests build the graph for the micro profile without touching the environment.
"""

from __future__ import annotations

import dagster as dg

from assets import (
    automation,
    benchmark_report,
    cleanup_hidden_states,
    drafter_checkpoint,
    extraction_plan,
    hidden_states,
    merged_train,
    raw_responses,
    partition_status,
    settings,
    target_model,
    tokenized_dataset,
    vocab_mapping,
)
from assets._common import EXECUTOR, OWNERS, silenced_warnings
from eagle3_dagster import storage
from eagle3_dagster.config import Profile, load_profile
from resources.chat_api import ChatApiResource
from resources.gpu_host import GpuHostResource
from resources.profile import ProfileResource
from resources.upstream import UPSTREAM, UpstreamMaterializations

# The modules of this code location's assets, in the graph's order; each gives its asset as a profile builds it.
ASSET_MODULES = [
    target_model,
    raw_responses,
    tokenized_dataset,
    merged_train,
    vocab_mapping,
    extraction_plan,
    hidden_states,
    drafter_checkpoint,
    benchmark_report,
]


def build_definitions(profile: Profile) -> dg.Definitions:
    storage.configure(profile.storage)  # every store call of this code location and its run workers
    assets = settings.with_code_versions(
        with_owners_and_source_links([module.for_profile(profile) for module in ASSET_MODULES])
    )
    specs = [spec for a in assets if a.is_materializable for spec in a.specs]
    jobs = automation.build_jobs(profile, partition_status.check_keys(specs))
    checks, status_sensor = partition_status.build(specs)
    api_key = dg.EnvVar(profile.generation.api_key_env) if profile.generation.backend == "openai" else None
    return dg.Definitions(
        assets=assets,
        asset_checks=checks,
        executor=EXECUTOR,
        jobs=[*jobs.values(), cleanup_hidden_states.cleanup_job(profile)],
        sensors=[
            automation.build_sensor(profile),
            automation.build_automation_sensor(profile),
            settings.build_sensor(specs),
            status_sensor,
        ],
        resources={
            "profile": ProfileResource.of(profile),
            "chat_api": ChatApiResource(api_key=api_key),
            "gpu_host": GpuHostResource.from_profile(profile),
            UPSTREAM: UpstreamMaterializations(),
        },
    )


def with_owners_and_source_links(assets: list[dg.AssetsDefinition]) -> list[dg.AssetsDefinition]:
    """Owners on every asset and a link from its page to the function that defines it (file and line).

    The production target is an observed asset, which takes neither.
    """
    built = [
        a.map_asset_specs(lambda spec: spec.replace_attributes(owners=OWNERS)) if a.is_materializable else a
        for a in assets
    ]
    with silenced_warnings(
        dg.BetaWarning,
        "Function `with_source_code_references`",
        "Class `LocalFileCodeReference`",
        "Class `CodeReferencesMetadataValue`",
    ):
        # Beta in 1.13, and Dagster's only link to the source
        linked = dg.with_source_code_references([a for a in built if a.is_materializable])
    return [*linked, *[a for a in built if not a.is_materializable]]


defs = build_definitions(load_profile())
