"""The one Definitions object of the eagle3_dagster code location.

The profile is chosen by EAGLE3_PROFILE (default: demo) when Dagster loads this
file; `build_definitions` takes a profile explicitly so tests build the graph
for the micro profile without touching the environment.
"""

from __future__ import annotations

import dagster as dg

from assets import automation, drafter_checkpoint, hidden_states, merged_train, raw_responses, settings, shard_status
from assets import target_model
from assets._common import EXECUTOR, OWNERS, accepted
from assets import tokenized_dataset
from eagle3_dagster import storage
from eagle3_dagster.config import Profile, load_profile
from resources.chat_api import ChatApiResource
from resources.gpu_host import GpuHostResource
from resources.upstream import UPSTREAM, UpstreamMaterializations

# The modules that build this code location's assets and jobs (the graph's order is their assets' deps).
ASSET_MODULES = [target_model, raw_responses, tokenized_dataset, merged_train, hidden_states, drafter_checkpoint]


def build_definitions(profile: Profile) -> dg.Definitions:
    storage.configure(profile.storage)  # every store call of this code location and its run workers
    parts = dg.Definitions.merge(*(module.build(profile) for module in ASSET_MODULES))
    assets = settings.with_code_versions(described(list(parts.assets)))
    specs = [spec for a in assets if isinstance(a, dg.AssetsDefinition) for spec in a.specs]
    jobs = automation.build_jobs(profile)
    check, status_sensor = shard_status.build(next(s for s in specs if s.key == shard_status.ASSET))
    api_key = dg.EnvVar(profile.generation.api_key_env) if profile.generation.backend == "openai" else None
    return dg.Definitions(
        assets=assets,
        asset_checks=[check],
        executor=EXECUTOR,
        jobs=[*jobs.values(), *parts.jobs],
        sensors=[automation.build_sensor(profile), automation.build_automation_sensor(profile),
                 settings.build_sensor(specs), status_sensor],
        resources={
            "chat_api": ChatApiResource(api_key=api_key),
            "gpu_host": GpuHostResource.from_profile(profile),
            UPSTREAM: UpstreamMaterializations(),
        },
    )


def described(assets: list) -> list:
    """Owners on every asset and a link from its page to the function that defines it (file and line).

    The production target is an observed source asset, which takes neither.
    """
    built = [a.map_asset_specs(lambda spec: spec.replace_attributes(owners=OWNERS))
             if isinstance(a, dg.AssetsDefinition) else a for a in assets]
    with accepted(dg.BetaWarning, "Function `with_source_code_references`", "Class `LocalFileCodeReference`",
                  "Class `CodeReferencesMetadataValue`"):  # Beta in 1.13, and Dagster's only link to the source
        linked = dg.with_source_code_references([a for a in built if isinstance(a, dg.AssetsDefinition)])
    return [*linked, *[a for a in built if not isinstance(a, dg.AssetsDefinition)]]


defs = build_definitions(load_profile())
