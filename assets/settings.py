"""Which settings each asset's output depends on, and how an edit to them reaches the UI.

An asset hands its engine stage one typed settings object (`eagle3_dagster.stages.StageSettings`), built from the
profile, and declares that object's `content()` (the settings that change what the stage writes) as its
definition metadata with `stage_settings_metadata`: what a code version covers is derived from what the stage
is given, never listed a second time.

Dagster marks an asset stale when its own code version changes or when an
input's data version changed since it was materialized; a stale parent does not
make its children stale. An edit to `data.max_seq_len` invalidates everything
below merged_train long before merged_train is rebuilt, so each asset's code
version hashes the settings its stage is given *and* those of every asset whose content it
consumes: its deps in the built graph (`content_inputs`), but for an input named in `gating_inputs`, whose verdict
it waits for but whose content it does not read. The edit marks every invalidated asset stale at the next
reload, and only those (an edit to `hidden.backfill_cron` invalidates nothing). `with_code_versions` writes the
code versions, and the settings they hash as each asset's definition metadata, once the graph is built.

Every materialization records the settings it was built with; the
`changed_settings` sensor compares them with the loaded profile and reports the
difference as an observation on each invalidated asset, so the asset page names
what changed (`data.max_seq_len: 192 → 256`), not just a new hash.
"""

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import dagster as dg

from eagle3_dagster.stages import StageSettings

CODE_VERSION = "2"
SETTINGS_KEY = "settings"
CHANGED_KEY = "changed_settings"
GATE_KEY = "eagle3/gate"


def stage_settings_metadata(*given: StageSettings) -> dict[str, dg.MetadataValue]:
    """Definition metadata naming the settings the asset's stage is given that change what it writes (the
    asset's own part of its code version; `with_code_versions` adds those of its inputs)."""
    content: dict[str, Any] = {}
    for settings in given:
        content |= settings.content()
    return {SETTINGS_KEY: dg.MetadataValue.json(dict(sorted(content.items())))}


def with_stage_settings(asset: dg.AssetsDefinition, settings: StageSettings, **attributes: Any) -> dg.AssetsDefinition:
    """A module-level asset as a profile builds it: the settings its stage is given, as the asset's own part of
    its code version (`stage_settings_metadata`), and the spec attributes the profile decides (`attributes`:
    partitions, automation, a description naming the profile's values)."""
    metadata = stage_settings_metadata(settings)
    return asset.map_asset_specs(
        lambda spec: spec.replace_attributes(metadata={**spec.metadata, **metadata}, **attributes)
    )


def gating_inputs(**why: str) -> dict[str, dg.MetadataValue]:
    """Definition metadata naming the inputs whose verdict the asset waits for and whose content it does not
    read (input name = the upstream asset's name → why): their settings stay out of its code version."""
    return {GATE_KEY: dg.MetadataValue.json(why)}


def content_inputs(specs: Iterable[dg.AssetSpec]) -> dict[str, tuple[str, ...]]:
    """The assets whose content each asset reads: its deps in the graph, but for gates."""
    graph = {}
    for spec in specs:
        gates = spec.metadata[GATE_KEY].data if GATE_KEY in spec.metadata else {}
        graph[spec.key.to_user_string()] = tuple(
            dep.asset_key.to_user_string() for dep in spec.deps if dep.asset_key.to_user_string() not in gates
        )
    return graph


def _with_inputs(asset: str, own: Mapping[str, dict[str, Any]], graph: Mapping[str, tuple[str, ...]]) -> dict[str, Any]:
    """The asset's own settings and, transitively, those of every asset whose content it reads."""
    settings = dict(own.get(asset, {}))
    for parent in graph.get(asset, ()):  # an observed source asset has no inputs
        settings.update(_with_inputs(parent, own, graph))
    return dict(sorted(settings.items()))


def code_version(settings: Mapping[str, Any]) -> str:
    """An asset's code version: bumped by hand when its code changes, plus a hash of its settings."""
    payload = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return f"{CODE_VERSION}-{hashlib.sha256(payload.encode()).hexdigest()[:12]}"


def with_code_versions(assets: list) -> list:
    """The assets with their code versions and the settings these hash (definition metadata `settings`).

    Computed from the built graph: an asset's code version cannot be known before its inputs'.
    """
    specs = [spec for a in assets for spec in a.specs]
    own = {
        spec.key.to_user_string(): spec.metadata[SETTINGS_KEY].data for spec in specs if SETTINGS_KEY in spec.metadata
    }
    graph = content_inputs(specs)

    def with_settings(spec: dg.AssetSpec) -> dg.AssetSpec:
        settings = _with_inputs(spec.key.to_user_string(), own, graph)
        return spec.replace_attributes(
            code_version=code_version(settings),
            metadata={**spec.metadata, SETTINGS_KEY: dg.MetadataValue.json(settings)},
        )

    # an observed asset (the production target) has settings, which its children hash, and no code version
    return [a.map_asset_specs(with_settings) if a.is_materializable else a for a in assets]


def recorded_settings(context: dg.AssetExecutionContext) -> dict[str, dg.MetadataValue]:
    """What a materialization records: the settings its asset's definition was built with."""
    spec = context.assets_def.specs_by_key[context.asset_key]
    return {SETTINGS_KEY: spec.metadata[SETTINGS_KEY]}


def changed_settings(recorded: dict[str, Any], current: dict[str, Any]) -> list[dict[str, str]]:
    """One row per setting whose value differs, as the UI table shows them."""
    rows = []
    for path in sorted(set(recorded) | set(current)):
        before, after = recorded.get(path, "(not set)"), current.get(path, "(not set)")
        if before != after:
            rows.append({"setting": path, "before": _text(before), "after": _text(after)})
    return rows


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


CHANGED_SCHEMA = dg.TableSchema(
    columns=[
        dg.TableColumn("setting", "string", description="dotted path in the profile"),
        dg.TableColumn("before", "string", description="value at the asset's latest materialization"),
        dg.TableColumn("after", "string", description="value in the loaded profile"),
    ]
)


def build_sensor(specs: Iterable[dg.AssetSpec]) -> dg.SensorDefinition:
    """`specs`: the built graph's, carrying the settings `with_code_versions` wrote."""
    current = {
        spec.key.to_user_string(): spec.metadata[SETTINGS_KEY].data for spec in specs if SETTINGS_KEY in spec.metadata
    }

    @dg.sensor(
        name="changed_settings",
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="After a profile edit and a reload, names on each invalidated asset the settings that "
        "differ from those its latest materialization was built with (an observation with a table); after a "
        "revert, an observation with an empty table says they match again.",
    )
    def changed_settings_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        reported: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
        events = []
        for asset, now in current.items():
            recorded, materialization = _recorded_settings(context.instance, asset)
            if recorded is None:
                continue
            rows = changed_settings(recorded, now)
            digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16] if rows else ""
            before, _, reported_against = reported.get(asset, "").partition("@")
            # a change not reported yet, or a reported one reverted while the same materialization is the latest
            # (a newer materialization supersedes the observation on the asset page itself)
            reverted = not rows and before and reported_against == str(materialization)
            if (rows and before != digest) or reverted:
                events.append(
                    dg.AssetObservation(
                        asset_key=asset,
                        metadata={
                            CHANGED_KEY: dg.MetadataValue.table(
                                [dg.TableRecord(r) for r in rows], schema=CHANGED_SCHEMA
                            ),
                            "changed_setting_names": ", ".join(r["setting"] for r in rows),
                            "num_changed_settings": len(rows),
                        },
                    )
                )
            reported[asset] = f"{digest}@{materialization}"
        return dg.SensorResult(asset_events=events, cursor=json.dumps(reported, sort_keys=True))

    return changed_settings_sensor


def _recorded_settings(instance: dg.DagsterInstance, asset: str) -> tuple[dict[str, Any] | None, int | None]:
    """The settings the asset's latest materialization recorded, and that materialization's storage id."""
    records = instance.fetch_materializations(dg.AssetKey(asset), limit=1).records
    if not records or records[0].asset_materialization is None:
        return None, None
    data = records[0].asset_materialization.metadata.get(SETTINGS_KEY)
    data = data.value if isinstance(data, dg.MetadataValue) else data
    return (data if isinstance(data, dict) else None), records[0].storage_id
