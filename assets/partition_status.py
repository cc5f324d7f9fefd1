"""`partitions_current`: which partitions of each partitioned asset are current, shown where Dagster 1.13 can
show it.

Dagster computes staleness per partition (GraphQL `staleStatusByPartition`) but its UI draws it for no
partition: after an edit to `data.max_seq_len`, which makes every dataset of raw_responses and
tokenized_dataset and every shard of hidden_states stale, the graph, the catalog and the Partitions tab stay
green, and a partitioned asset reads "✓ All". A check per partition cannot carry it either: a verdict reported
outside a run is stored under run id "" and `asset_check_executions` has a unique index on (asset key, check,
run id, partition) (`idx_asset_check_executions_unique` in dagster/_core/storage/event_log/schema.py), so each
check partition takes one runless verdict, ever; the second raises IntegrityError. An unpartitioned check has
partition NULL and takes any number.

So each partitioned asset (raw_responses, tokenized_dataset: one partition per dataset; hidden_states: one per
shard) carries one check on the whole asset holding the per-partition verdicts: its table `not_current` lists
every partition that is stale (with the cause), missing, failed or in progress, beside counts and a one-line
description. It fails as an error while a partition is missing or failed and as a warning while partitions are
only stale or in progress, and passes again once the edit is reverted or the partitions rebuilt. The
`partition_status` sensor reports each asset's check whenever a verdict or the asset's latest materialization
changes (the UI shows a verdict only while it is newer than the latest materialization); the check can also
be executed from the asset page. The jobs that materialize partitions leave it out (automation.build_jobs).

"Stale" is Dagster's own rule (dagster/_core/definitions/data_version.py,
`CachingStaleStatusResolver._get_stale_causes_materialized`), read from the same tags: the code version the
partition was built with differs from the loaded one, or an input's data version differs from the one recorded
when the partition was built. An input partitioned as the asset is (tokenized_dataset's raw_responses: the same
dataset) is compared partition by partition, as Dagster does (`_is_dep_updated`): whether that partition has a
newer materialization, after the one the asset read, with another data version; any other input by its data
version now against the one recorded.
"""

# No `from __future__ import annotations`: Dagster reads the check's context annotation at definition time.
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import dagster as dg

from assets.metadata_legend import LEGEND_KEY, markdown_legend

CHECK = "partitions_current"
STATUS_SENSOR = "partition_status"
# Not current, worst first: the order of the table and of the description.
STATUSES = ("failed", "missing", "stale", "in progress")
ERRORS = {"failed", "missing"}

NOT_CURRENT_SCHEMA = dg.TableSchema(
    columns=[
        dg.TableColumn("partition", "string", description="the partition (a dataset, or a hidden_states shard)"),
        dg.TableColumn(
            "status",
            "string",
            description="failed (latest run failed), missing (never materialized), "
            "stale (built from other settings or inputs) or in progress",
        ),
        dg.TableColumn("cause", "string", description="why, in Dagster's staleness terms"),
    ]
)
METADATA = {  # the verdict's metadata_legend
    "num_partitions": "the asset's partitions (datasets of the profile, or shards of the latest merged_train)",
    "num_current": "partitions materialized with the loaded settings from the current inputs",
    "num_stale": "partitions built from other settings or other inputs (Dagster's STALE)",
    "num_missing": "partitions never materialized",
    "num_failed": "partitions whose latest run failed",
    "num_in_progress": "partitions a run is materializing now",
    "not_current": "one row per partition that is not current, worst first",
}


@dataclass(frozen=True)
class Verdict:
    partition: str
    status: str  # "current" or one of STATUSES
    cause: str = ""


@dataclass(frozen=True)
class Watched:
    """A partitioned asset as built: what its partitions are current against."""

    key: dg.AssetKey
    partitions_def: dg.PartitionsDefinition
    code_version: str | None
    deps: tuple[str, ...]  # every dep's data version is recorded in each partition
    same_partitions: frozenset[str]  # the deps partitioned as the asset is, compared partition by partition
    noun: str  # what a partition is, for the description: "shard", "dataset"

    @classmethod
    def of(cls, spec: dg.AssetSpec, specs: Sequence[dg.AssetSpec]) -> "Watched":
        assert spec.partitions_def is not None, spec.key
        by_key = {s.key: s for s in specs}
        deps = tuple(dep.asset_key.to_user_string() for dep in spec.deps)
        same = frozenset(
            dep.asset_key.to_user_string()
            for dep in spec.deps
            if dep.asset_key in by_key and by_key[dep.asset_key].partitions_def == spec.partitions_def
        )
        noun = "shard" if isinstance(spec.partitions_def, dg.DynamicPartitionsDefinition) else "dataset"
        return cls(spec.key, spec.partitions_def, spec.code_version, deps, same, noun)


def verdicts(instance: dg.DagsterInstance, asset: Watched) -> list[Verdict]:
    """One verdict per partition of `asset`, from the instance's records (no file is read)."""
    keys = sorted(asset.partitions_def.get_partition_keys(dynamic_partitions_store=instance))
    if not keys:
        return []
    status = instance.get_status_by_partition(asset.key, keys, asset.partitions_def) or {}
    latest = _latest_materializations(instance, asset.key, keys)
    whole = {
        name: _data_version(instance, dg.AssetKey(name)) for name in asset.deps if name not in asset.same_partitions
    }
    out = []
    for key in keys:
        if status.get(key) == dg.AssetPartitionStatus.IN_PROGRESS:
            out.append(Verdict(key, "in progress", "a run is materializing it"))
        elif status.get(key) == dg.AssetPartitionStatus.FAILED:
            out.append(Verdict(key, "failed", "its latest run failed"))
        elif key not in latest:
            out.append(Verdict(key, "missing", "never materialized"))
        else:
            causes = _stale_causes(instance, latest[key], key, asset, whole)
            out.append(Verdict(key, "stale", "; ".join(causes)) if causes else Verdict(key, "current"))
    return out


def _latest_materializations(
    instance: dg.DagsterInstance, asset: dg.AssetKey, keys: list[str]
) -> dict[str, dg.EventLogRecord]:
    found: dict[str, dg.EventLogRecord] = {}
    cursor = None
    while len(found) < len(keys):
        page = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=asset, asset_partitions=keys), limit=1000, cursor=cursor
        )
        for record in page.records:  # newest first
            if record.partition_key is not None:
                found.setdefault(record.partition_key, record)
        if not page.has_more:
            break
        cursor = page.cursor
    return found


def _tag_data_version(record: dg.EventLogRecord | None) -> str | None:
    event = record.asset_event if record else None
    return event.tags.get("dagster/data_version") if event and event.tags else None


def _data_version(instance: dg.DagsterInstance, key: dg.AssetKey) -> str | None:
    """The input's current data version: its latest materialization's, or observation's (an external target)."""
    records = [
        *instance.fetch_materializations(key, limit=1).records,
        *instance.fetch_observations(key, limit=1).records,
    ]
    return _tag_data_version(max(records, key=lambda r: r.storage_id)) if records else None


def _partition_updated(instance: dg.DagsterInstance, dep: dg.AssetKey, partition: str, read: int | None) -> bool:
    """Whether the dep's `partition` has a new data version since the materialization the asset read (storage id
    `read`, its input_event_pointer tag). Dagster records no comparable input data version for a partitioned
    input, so this is its own test (`_is_dep_updated`): the newest record after the one read against it."""
    newer = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dep, asset_partitions=[partition], after_storage_id=read), limit=1
    ).records
    if not newer:
        return False
    before = dg.AssetRecordsFilter(
        asset_key=dep, asset_partitions=[partition], before_storage_id=read + 1 if read is not None else None
    )
    previous = instance.fetch_materializations(before, limit=1).records if read is not None else []
    return _tag_data_version(newer[0]) != (_tag_data_version(previous[0]) if previous else None)


def _stale_causes(
    instance: dg.DagsterInstance,
    record: dg.EventLogRecord,
    partition: str,
    asset: Watched,
    whole: dict[str, str | None],
) -> list[str]:
    materialization = record.asset_materialization
    provenance = dg.DataProvenance.from_tags(materialization.tags or {}) if materialization else None
    if provenance is None:  # built before data versions were recorded: nothing to compare
        return []
    causes = []
    if provenance.code_version != asset.code_version:
        causes.append(f"code version {provenance.code_version} → {asset.code_version}: a setting it reads changed")
    for name in asset.deps:
        dep = dg.AssetKey(name)
        if name in asset.same_partitions:
            read = provenance.input_storage_ids.get(dep)
            updated = dep not in provenance.input_data_versions or _partition_updated(instance, dep, partition, read)
        else:
            recorded, now = provenance.input_data_versions.get(dep), whole[name]
            updated = now is not None and (recorded is None or recorded.value != now)
        if updated:
            causes.append(f"{name} has a new data version")
    return causes


def verdict_fields(asset: Watched, found: list[Verdict]) -> dict:
    """The check's verdict as AssetCheckResult / AssetCheckEvaluation keywords."""
    counts = {s: sum(v.status == s for v in found) for s in ("current", *STATUSES)}
    bad = sorted((v for v in found if v.status != "current"), key=lambda v: (STATUSES.index(v.status), v.partition))
    metadata = {
        "num_partitions": len(found),
        **{f"num_{s.replace(' ', '_')}": n for s, n in counts.items()},
        "not_current": dg.MetadataValue.table([dg.TableRecord(v.__dict__) for v in bad], schema=NOT_CURRENT_SCHEMA),
        LEGEND_KEY: markdown_legend(METADATA.items()),
    }
    if not found:
        return dict(
            passed=False,
            severity=dg.AssetCheckSeverity.ERROR,
            metadata=metadata,
            description=f"no {asset.noun} is registered: {asset.key.to_user_string()} has no partitions until "
            "merged_train materializes (its sensor registers one per shard)",
        )
    nouns = f"{asset.noun}s" if len(found) > 1 else asset.noun
    if not bad:
        done = f"all {len(found)} {nouns} are current" if len(found) > 1 else f"its only {asset.noun} is current"
        return dict(passed=True, metadata=metadata, description=done)
    parts = ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])
    severity = dg.AssetCheckSeverity.ERROR if ERRORS & {v.status for v in bad} else dg.AssetCheckSeverity.WARN
    return dict(
        passed=False,
        severity=severity,
        metadata=metadata,
        description=f"{len(bad)} of {len(found)} {nouns} {'is' if len(bad) == 1 else 'are'} not current ({parts}): "
        "see the table not_current",
    )


def check_keys(specs: Sequence[dg.AssetSpec]) -> list[dg.AssetCheckKey]:
    """The partitions_current check of every partitioned asset among `specs`."""
    return [dg.AssetCheckKey(s.key, CHECK) for s in specs if s.partitions_def is not None]


def build(specs: Sequence[dg.AssetSpec]) -> tuple[list[dg.AssetChecksDefinition], dg.SensorDefinition]:
    """The check of each partitioned asset among `specs` as built (its code version and deps), and the one
    sensor that reports them."""
    watched = [Watched.of(s, specs) for s in specs if s.partitions_def is not None]
    checks = [_check(asset) for asset in watched]

    @dg.sensor(
        name=STATUS_SENSOR,
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Reports the {CHECK} check of "
        + ", ".join(a.key.to_user_string() for a in watched)
        + " (which partitions are stale, missing or failed) whenever a partition's verdict or the asset's "
        "latest materialization changes.",
    )
    def partition_status(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        try:
            reported = json.loads(context.cursor or "{}")
        except ValueError:  # a cursor of the one-asset sensor this replaced
            reported = {}
        reported = reported if isinstance(reported, dict) else {}
        events = []
        for asset in watched:
            found = verdicts(context.instance, asset)
            newest = context.instance.fetch_materializations(asset.key, limit=1).records
            state = json.dumps([[v.__dict__ for v in found], newest[0].storage_id if newest else None])
            digest = hashlib.sha256(state.encode()).hexdigest()[:16]
            name = asset.key.to_user_string()
            if reported.get(name) != digest:
                events.append(
                    dg.AssetCheckEvaluation(asset_key=asset.key, check_name=CHECK, **verdict_fields(asset, found))
                )
                reported[name] = digest
        return dg.SensorResult(asset_events=events, cursor=json.dumps(reported, sort_keys=True))

    return checks, partition_status


def _check(asset: Watched) -> dg.AssetChecksDefinition:
    @dg.asset_check(
        asset=asset.key,
        name=CHECK,
        blocking=False,
        description=f"Every {asset.noun} is materialized, its latest run succeeded, and it was built with the "
        f"loaded settings from the current inputs. The table not_current lists each {asset.noun} that is not, "
        f"with why. Reported by the {STATUS_SENSOR} sensor; Dagster's UI shows no staleness per partition.",
    )
    def partitions_current(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        return dg.AssetCheckResult(**verdict_fields(asset, verdicts(context.instance, asset)))

    return partitions_current
