"""`shards_current`: which hidden_states shards are current, shown where Dagster 1.13 can show it.

Dagster computes staleness per partition (GraphQL `staleStatusByPartition`) but its UI draws
it for no partition: after an edit that makes every shard stale, the graph, the catalog and
the Partitions tab stay green, and an asset with no partitions reads "✓ All". A check per
shard cannot carry it either: a verdict reported outside a run is stored under run id ""
and `asset_check_executions` has a unique index on (asset key, check, run id, partition)
(`idx_asset_check_executions_unique` in dagster/_core/storage/event_log/schema.py), so each
check partition takes one runless verdict, ever; the second raises IntegrityError. An
unpartitioned check has partition NULL and takes any number.

So one check on the whole asset holds the per-shard verdicts: its table `not_current` lists
every shard that is stale (with the cause), missing, failed or in progress, beside counts
and a one-line description. It fails as an error while a shard is missing or failed and as a
warning while shards are only stale or in progress. The `shard_status` sensor reports it
whenever a verdict or the asset's latest materialization changes (the UI shows a verdict
only while it is newer than the latest materialization); the check can also be executed
from the asset page. Shard runs leave it out (automation.build_jobs).

"Stale" is Dagster's own rule (dagster/_core/definitions/data_version.py,
`CachingStaleStatusResolver._get_stale_causes_materialized`), read from the same tags: the
code version the shard was built with differs from the loaded one, or an input's data
version differs from the one recorded when the shard was built.
"""

# No `from __future__ import annotations`: Dagster reads the check's context annotation at definition time.
import hashlib
import json
from dataclasses import dataclass

import dagster as dg

from assets.partitions import HIDDEN_STATE_SHARDS

SHARDS_CURRENT = "shards_current"
STATUS_SENSOR = "shard_status"
ASSET = dg.AssetKey("hidden_states")
# Not current, worst first: the order of the table and of the description.
STATUSES = ("failed", "missing", "stale", "in progress")
ERRORS = {"failed", "missing"}

NOT_CURRENT_SCHEMA = dg.TableSchema(
    columns=[
        dg.TableColumn("shard", "string", description="the hidden_states partition"),
        dg.TableColumn(
            "status",
            "string",
            description="failed (latest run failed), missing (never materialized), "
            "stale (built from other settings or inputs) or in progress",
        ),
        dg.TableColumn("cause", "string", description="why, in Dagster's staleness terms"),
    ]
)
METADATA = {
    "num_shards": "registered hidden_states partitions (one per shard of the latest merged_train)",
    "num_current": "shards materialized with the loaded settings from the current inputs",
    "num_stale": "shards built from other settings or other inputs (Dagster's STALE)",
    "num_missing": "shards never materialized",
    "num_failed": "shards whose latest run failed",
    "num_in_progress": "shards a run is extracting now",
    "not_current": "one row per shard that is not current, worst first",
}


@dataclass(frozen=True)
class ShardVerdict:
    shard: str
    status: str  # "current" or one of STATUSES
    cause: str = ""


def shard_verdicts(instance: dg.DagsterInstance, loaded_code_version: str, deps: tuple[str, ...]) -> list[ShardVerdict]:
    """One verdict per registered shard, from the instance's records (no file is read).

    `deps`: hidden_states' deps in the built graph; each one's data version is recorded in every shard.
    """
    keys = sorted(instance.get_dynamic_partitions(HIDDEN_STATE_SHARDS.name))
    if not keys:
        return []
    status = instance.get_status_by_partition(ASSET, keys, HIDDEN_STATE_SHARDS) or {}
    latest = _latest_materializations(instance, keys)
    inputs = {name: _data_version(instance, dg.AssetKey(name)) for name in deps}
    out = []
    for key in keys:
        if status.get(key) == dg.AssetPartitionStatus.IN_PROGRESS:
            out.append(ShardVerdict(key, "in progress", "a run is extracting it"))
        elif status.get(key) == dg.AssetPartitionStatus.FAILED:
            out.append(ShardVerdict(key, "failed", "its latest run failed"))
        elif key not in latest:
            out.append(ShardVerdict(key, "missing", "never materialized"))
        else:
            causes = _stale_causes(latest[key], loaded_code_version, inputs)
            out.append(ShardVerdict(key, "stale", "; ".join(causes)) if causes else ShardVerdict(key, "current"))
    return out


def _latest_materializations(instance: dg.DagsterInstance, keys: list[str]) -> dict[str, dg.EventLogRecord]:
    found: dict[str, dg.EventLogRecord] = {}
    cursor = None
    while len(found) < len(keys):
        page = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=ASSET, asset_partitions=keys), limit=1000, cursor=cursor
        )
        for record in page.records:  # newest first
            found.setdefault(record.partition_key, record)
        if not page.has_more:
            break
        cursor = page.cursor
    return found


def _data_version(instance: dg.DagsterInstance, key: dg.AssetKey) -> str | None:
    """The input's current data version: its latest materialization's, or observation's (an external target)."""
    records = [
        *instance.fetch_materializations(key, limit=1).records,
        *instance.fetch_observations(key, limit=1).records,
    ]
    if not records:
        return None
    event = max(records, key=lambda r: r.storage_id).asset_event
    return event.tags.get("dagster/data_version") if event and event.tags else None


def _stale_causes(record: dg.EventLogRecord, loaded_code_version: str, inputs: dict[str, str | None]) -> list[str]:
    provenance = dg.DataProvenance.from_tags(record.asset_materialization.tags or {})
    if provenance is None:  # built before data versions were recorded: nothing to compare
        return []
    causes = []
    if provenance.code_version != loaded_code_version:
        causes.append(f"code version {provenance.code_version} → {loaded_code_version}: a setting it reads changed")
    for name, now in inputs.items():
        recorded = provenance.input_data_versions.get(dg.AssetKey(name))
        if now is not None and (recorded is None or recorded.value != now):
            causes.append(f"{name} has a new data version")
    return causes


def verdict_fields(verdicts: list[ShardVerdict]) -> dict:
    """The check's verdict as AssetCheckResult / AssetCheckEvaluation keywords."""
    counts = {s: sum(v.status == s for v in verdicts) for s in ("current", *STATUSES)}
    bad = sorted((v for v in verdicts if v.status != "current"), key=lambda v: (STATUSES.index(v.status), v.shard))
    metadata = {
        "num_shards": len(verdicts),
        **{f"num_{s.replace(' ', '_')}": n for s, n in counts.items()},
        "not_current": dg.MetadataValue.table([dg.TableRecord(v.__dict__) for v in bad], schema=NOT_CURRENT_SCHEMA),
    }
    if not verdicts:
        return dict(
            passed=False,
            severity=dg.AssetCheckSeverity.ERROR,
            metadata=metadata,
            description="no shard is registered: hidden_states has no partitions until merged_train "
            "materializes (its sensor registers one per shard)",
        )
    if not bad:
        return dict(passed=True, metadata=metadata, description=f"all {len(verdicts)} shards are current")
    parts = ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])
    severity = dg.AssetCheckSeverity.ERROR if ERRORS & {v.status for v in bad} else dg.AssetCheckSeverity.WARN
    return dict(
        passed=False,
        severity=severity,
        metadata=metadata,
        description=f"{len(bad)} of {len(verdicts)} shards are not current ({parts}): see the table not_current",
    )


def build(spec: dg.AssetSpec) -> list:
    """The check and its sensor for hidden_states as built (`spec`: its code version and deps)."""
    loaded = spec.code_version
    deps = tuple(dep.asset_key.to_user_string() for dep in spec.deps)

    @dg.asset_check(
        asset=ASSET,
        name=SHARDS_CURRENT,
        blocking=False,
        description="Every registered shard is materialized, its latest run succeeded, and it was built with the "
        "loaded settings from the current inputs. The table not_current lists each shard that is not, with why. "
        f"Reported by the {STATUS_SENSOR} sensor; Dagster's UI shows no staleness per partition.",
    )
    def shards_current(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        return dg.AssetCheckResult(**verdict_fields(shard_verdicts(context.instance, loaded, deps)))

    @dg.sensor(
        name=STATUS_SENSOR,
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Reports hidden_states' {SHARDS_CURRENT} check (which shards are stale, missing or failed) "
        "whenever a shard's verdict or the asset's latest materialization changes.",
    )
    def shard_status(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        verdicts = shard_verdicts(context.instance, loaded, deps)
        newest = context.instance.fetch_materializations(ASSET, limit=1).records
        state = json.dumps([[v.__dict__ for v in verdicts], newest[0].storage_id if newest else None])
        digest = hashlib.sha256(state.encode()).hexdigest()[:16]
        if digest == context.cursor:
            return dg.SensorResult(cursor=digest)
        evaluation = dg.AssetCheckEvaluation(asset_key=ASSET, check_name=SHARDS_CURRENT, **verdict_fields(verdicts))
        return dg.SensorResult(asset_events=[evaluation], cursor=digest)

    return [shards_current, shard_status]
