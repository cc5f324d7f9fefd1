"""A snapshot of the whole Definitions graph for the micro profile, checked in beside this file.

Every structural fact a reader or the daemon relies on (assets with their deps, groups, partitions,
pools, kinds, resources, retry policy and automation condition; asset checks and which block; jobs
with their selection, partitions and tags; sensors and schedules; resources) is compared with
`definitions_snapshot.json`, so a change to any of them fails here and shows in review as a diff of
that file. Code versions are left out: they are hashes of the settings, tested for what they
invalidate in test_definitions.py.

After an intended change, regenerate the file and commit it with the change:

    EAGLE3_UPDATE_SNAPSHOT=1 .venv/bin/python -m pytest tests/assets/test_definitions_snapshot.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import dagster as dg

from definitions import build_definitions
from eagle3_dagster.config import load_profile

SNAPSHOT = Path(__file__).with_name("definitions_snapshot.json")
UPDATE_ENV = "EAGLE3_UPDATE_SNAPSHOT"


def _partitions(pd) -> dict | None:
    if pd is None:
        return None
    out: dict = {"type": type(pd).__name__}
    if isinstance(pd, dg.DynamicPartitionsDefinition):
        out["name"] = pd.name
    elif isinstance(pd, dg.StaticPartitionsDefinition):
        out["keys"] = list(pd.get_partition_keys())
    else:
        out["repr"] = str(pd)
    return out


def _condition(cond) -> str | None:
    """The automation condition as one line: a labelled node by its label, others by name(children)."""
    if cond is None:
        return None
    label = cond.get_label()
    if label:
        return label
    children = [_condition(c) for c in cond.children]
    return cond.name + (f"({', '.join(children)})" if children else "")


def snapshot(defs: dg.Definitions) -> dict:
    graph = defs.resolve_asset_graph()
    repo = defs.get_repository_def()
    assets = {}
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        assets_def = defs.resolve_assets_def(key)
        retry = assets_def.op.retry_policy
        assets[key.to_user_string()] = {
            "group": node.group_name,
            "deps": sorted(p.to_user_string() for p in node.parent_keys),
            "partitions": _partitions(node.partitions_def),
            "pools": sorted(node.pools or ()),
            "kinds": sorted(node.kinds),
            "materializable": node.is_materializable,
            "observable": node.is_observable,
            "has_code_version": node.code_version is not None,
            "resources": sorted(assets_def.required_resource_keys - {"io_manager"}),
            "retry_max": retry.max_retries if retry else None,
            "automation_condition": _condition(node.automation_condition),
        }
    checks = {}
    for key in sorted(graph.asset_check_keys, key=lambda k: (k.asset_key.to_user_string(), k.name)):
        node = graph.get(key)
        checks[f"{key.asset_key.to_user_string()}:{key.name}"] = {
            "blocking": node.blocking,
            "partitions": _partitions(node.partitions_def),
        }
    jobs = {}
    for job in sorted(defs.resolve_all_job_defs(), key=lambda j: j.name):
        if job.name.startswith("__"):
            continue
        jobs[job.name] = {
            "assets": sorted(k.to_user_string() for k in job.asset_layer.selected_asset_keys),
            "ops": sorted(n.name for n in job.nodes) if not job.asset_layer.selected_asset_keys else None,
            "partitions": _partitions(job.partitions_def),
            "tags": dict(sorted(job.tags.items())),
        }
    sensors = {
        s.name: {
            "type": s.sensor_type.value,
            "default_status": s.default_status.value,
            "minimum_interval_seconds": s.minimum_interval_seconds,
            "asset_selection": str(s.asset_selection) if s.asset_selection is not None else None,
            "asset_key": s.asset_key.to_user_string() if isinstance(s, dg.AssetSensorDefinition) else None,
        }
        for s in sorted(repo.sensor_defs, key=lambda s: s.name)
    }
    schedules = {
        s.name: {"cron": s.cron_schedule, "job": s.job_name} for s in sorted(repo.schedule_defs, key=lambda s: s.name)
    }
    return {
        "assets": assets,
        "checks": checks,
        "jobs": jobs,
        "sensors": sensors,
        "schedules": schedules,
        "resources": sorted(defs.resources or {}),
    }


def test_definitions_match_the_checked_in_snapshot() -> None:
    current = snapshot(build_definitions(load_profile("micro")))
    text = json.dumps(current, indent=2, sort_keys=True) + "\n"
    if os.environ.get(UPDATE_ENV) == "1":
        SNAPSHOT.write_text(text)
    assert SNAPSHOT.exists(), f"{SNAPSHOT} missing: run with {UPDATE_ENV}=1 to write it"
    expected = json.loads(SNAPSHOT.read_text())
    changed = sorted(
        f"{section}.{name}"
        for section in set(expected) | set(current)
        for name in set(_names(expected.get(section))) | set(_names(current.get(section)))
        if _get(expected, section, name) != _get(current, section, name)
    )
    assert current == expected, (
        f"the Definitions differ from {SNAPSHOT.name} at {changed}; if intended, regenerate it with "
        f"{UPDATE_ENV}=1 and commit the diff"
    )


def _names(section) -> list:
    return list(section) if isinstance(section, dict) else ["*"]


def _get(snap: dict, section: str, name: str):
    value = snap.get(section)
    return value.get(name) if isinstance(value, dict) else value
