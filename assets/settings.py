"""Which settings each asset's output depends on, and how an edit to them reaches the UI.

Dagster marks an asset stale when its own code version changes or when an
input's data version changed since it was materialized; a stale parent does not
make its children stale. An edit to `data.max_seq_len` invalidates everything
below merged_train long before merged_train is rebuilt, so each asset's code
version hashes the settings it reads *and* those of every asset whose content it
consumes (`INPUTS`): the edit marks every invalidated asset stale at the next
reload, and only those (an edit to `hidden.backfill_cron` invalidates nothing).

Every materialization records the settings it was built with; the
`changed_settings` sensor compares them with the loaded profile and reports the
difference as an observation on each invalidated asset, so the asset page names
what changed (`data.max_seq_len: 192 → 256`), not just a new hash.
"""

import hashlib
import json
from typing import Any

import dagster as dg

from eagle3_dagster.config import Profile

CODE_VERSION = "2"
SETTINGS_KEY = "settings"
CHANGED_KEY = "changed_settings"

# The settings (dotted paths into the profile) that change an asset's own output.
READS: dict[str, tuple[str, ...]] = {
    "target_model": ("target.kind", "target.path", "target.dtype", "target.tiny"),
    "raw_responses": ("datasets", "generation.backend", "generation.base_url", "generation.model",
                      "generation.max_new_tokens", "generation.temperature", "generation.reasoning",
                      "generation.reasoning_style", "generation.extra_body", "data.max_seq_len",
                      "data.heldout_fraction"),
    "tokenized_dataset": ("datasets", "data.max_seq_len", "data.heldout_fraction", "data.bad_fraction_threshold"),
    "merged_train": ("data.max_seq_len", "data.shuffle_seed", "data.drop_datasets", "hidden.samples_per_shard"),
    "vocab_mapping": ("data.draft_vocab_size",),
    "extraction_plan": ("hidden.root", "hidden.backend", "hidden.aux_layers", "hidden.dtype",
                        "hidden.samples_per_shard", "hidden.batch_tokens", "hidden.throughput_tokens_per_s"),
    "hidden_states": ("hidden.root", "hidden.backend", "hidden.aux_layers", "hidden.dtype",
                      "hidden.samples_per_shard", "hidden.batch_tokens", "hidden.tp_size"),
    "drafter_checkpoint": ("train", "drafter", "target.serving_context"),
    "benchmark_report": ("bench",),
}
# The assets whose content an asset reads. extraction_plan is not among hidden_states' inputs: it gates
# the extraction, and its estimate (hours) is not in the shards.
INPUTS: dict[str, tuple[str, ...]] = {
    "target_model": (),
    "raw_responses": ("target_model",),
    "tokenized_dataset": ("raw_responses", "target_model"),
    "merged_train": ("tokenized_dataset",),
    "vocab_mapping": ("merged_train", "target_model"),
    "extraction_plan": ("merged_train", "target_model"),
    "hidden_states": ("merged_train", "target_model"),
    "drafter_checkpoint": ("hidden_states", "vocab_mapping", "target_model"),
    "benchmark_report": ("drafter_checkpoint", "target_model"),
}


def setting_paths(asset: str) -> list[str]:
    """The asset's own settings and, transitively, those of every asset whose content it reads."""
    paths: set[str] = set(READS[asset])
    for parent in INPUTS[asset]:
        paths.update(setting_paths(parent))
    return sorted(paths)


def settings_for(profile: Profile, asset: str) -> dict[str, Any]:
    return {path: _value(profile, path) for path in setting_paths(asset)}


def code_version(profile: Profile, asset: str) -> str:
    """Code version of the asset: bumped by hand when its code changes, plus a hash of its settings."""
    payload = json.dumps(settings_for(profile, asset), sort_keys=True, separators=(",", ":"))
    return f"{CODE_VERSION}-{hashlib.sha256(payload.encode()).hexdigest()[:12]}"


def changed_settings(recorded: dict[str, Any], current: dict[str, Any]) -> list[dict[str, str]]:
    """One row per setting whose value differs, as the UI table shows them."""
    rows = []
    for path in sorted(set(recorded) | set(current)):
        before, after = recorded.get(path, "(not set)"), current.get(path, "(not set)")
        if before != after:
            rows.append({"setting": path, "before": _text(before), "after": _text(after)})
    return rows


def settings_metadata(profile: Profile, asset: str) -> dict[str, dg.MetadataValue]:
    return {SETTINGS_KEY: dg.MetadataValue.json(settings_for(profile, asset))}


def _value(profile: Profile, path: str) -> Any:
    value: Any = profile
    for part in path.split("."):
        value = getattr(value, part)
    if isinstance(value, list):
        return [v.model_dump(mode="json") if hasattr(v, "model_dump") else v for v in value]
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


CHANGED_SCHEMA = dg.TableSchema(columns=[
    dg.TableColumn("setting", "string", description="dotted path in the profile"),
    dg.TableColumn("before", "string", description="value at the asset's latest materialization"),
    dg.TableColumn("after", "string", description="value in the loaded profile"),
])


def build_sensor(profile: Profile) -> dg.SensorDefinition:
    current = {asset: settings_for(profile, asset) for asset in READS}

    @dg.sensor(
        name="changed_settings",
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="After a profile edit and a reload, names on each invalidated asset the settings that "
        "differ from those its latest materialization was built with (an observation with a table).",
    )
    def changed_settings_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        reported: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
        events = []
        for asset, now in current.items():
            recorded = _recorded_settings(context.instance, asset)
            if recorded is None:
                continue
            rows = changed_settings(recorded, now)
            digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16] if rows else ""
            if rows and reported.get(asset) != digest:
                events.append(dg.AssetObservation(asset_key=asset, metadata={
                    CHANGED_KEY: dg.MetadataValue.table([dg.TableRecord(r) for r in rows], schema=CHANGED_SCHEMA),
                    "changed_setting_names": ", ".join(r["setting"] for r in rows),
                    "num_changed_settings": len(rows),
                }))
            reported[asset] = digest
        return dg.SensorResult(asset_events=events, cursor=json.dumps(reported, sort_keys=True))

    return changed_settings_sensor


def _recorded_settings(instance: dg.DagsterInstance, asset: str) -> dict[str, Any] | None:
    event = instance.get_latest_materialization_event(dg.AssetKey(asset))
    if event is None or event.asset_materialization is None:
        return None
    value = event.asset_materialization.metadata.get(SETTINGS_KEY)
    data = getattr(value, "data", None)
    return data if isinstance(data, dict) else None
