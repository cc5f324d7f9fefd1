"""After a profile edit, the `changed_settings` sensor names on each invalidated asset what changed.

Materializations carry the settings they were built with (as `materialize_result`
records them); the sensor of the edited profile's code location compares them with
what it loaded and reports one observation per invalidated asset, once per edit.
"""

from __future__ import annotations

import dagster as dg
import pytest

from assets.settings import SETTINGS_KEY
from definitions import build_definitions
from eagle3_dagster.config import load_profile

ASSETS = ["target_model", "merged_train", "vocab_mapping", "extraction_plan", "drafter_checkpoint"]


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        yield inst


def materialized_with(instance: dg.DagsterInstance, profile, *assets: str) -> None:
    """Materializations as `materialize_result` records them: the settings in the asset's built definition."""
    specs = {s.key.to_user_string(): s for s in build_definitions(profile).resolve_all_asset_specs()}
    for asset in assets:
        settings = {SETTINGS_KEY: specs[asset].metadata[SETTINGS_KEY]}
        instance.report_runless_asset_event(dg.AssetMaterialization(asset, metadata=settings))


def sensor_tick(profile, instance, cursor=None):
    defs = build_definitions(profile)
    repo = defs.get_repository_def()
    ctx = dg.build_sensor_context(instance=instance, cursor=cursor, repository_def=repo)
    return repo.get_sensor_def("changed_settings").evaluate_tick(ctx)


def observed(result) -> dict[str, list[dict]]:
    out = {}
    for event in result.asset_events:
        table = event.metadata["changed_settings"]
        out[event.asset_key.to_user_string()] = [dict(r.data) for r in table.records]
    return out


def test_an_edit_is_named_on_every_asset_it_invalidates(instance):
    materialized_with(instance, load_profile("micro"), *ASSETS)
    edited = load_profile("micro", overrides={"data": {"max_seq_len": 256}})
    result = sensor_tick(edited, instance)
    change = [{"setting": "data.max_seq_len", "before": "192", "after": "256"}]
    assert observed(result) == {
        "merged_train": change,
        "vocab_mapping": change,
        "extraction_plan": change,
        "drafter_checkpoint": change,
    }
    assert {e.metadata["changed_setting_names"].value for e in result.asset_events} == {"data.max_seq_len"}


def test_an_edit_is_reported_once_and_nothing_when_the_profile_matches(instance):
    profile = load_profile("micro")
    materialized_with(instance, profile, *ASSETS)
    assert sensor_tick(profile, instance).asset_events == []
    edited = load_profile("micro", overrides={"train": {"lr": 0.01}})
    first = sensor_tick(edited, instance)
    assert list(observed(first)) == ["drafter_checkpoint"]
    assert sensor_tick(edited, instance, cursor=first.cursor).asset_events == []
    # Rebuilt with the edited profile: nothing left to report.
    materialized_with(instance, edited, "drafter_checkpoint")
    assert sensor_tick(edited, instance, cursor=first.cursor).asset_events == []


def test_a_reverted_edit_is_reported_as_cleared_on_every_asset_it_was_named_on(instance):
    """After the revert, the newest changed_settings observation of each asset says nothing differs any more,
    instead of still reading the reverted change."""
    profile = load_profile("micro")
    materialized_with(instance, profile, *ASSETS)
    edited = load_profile("micro", overrides={"data": {"max_seq_len": 256}})
    first = sensor_tick(edited, instance)
    named = set(observed(first))
    reverted = sensor_tick(profile, instance, cursor=first.cursor)
    assert set(observed(reverted)) == named and all(rows == [] for rows in observed(reverted).values())
    assert {e.metadata["num_changed_settings"].value for e in reverted.asset_events} == {0}
    assert sensor_tick(profile, instance, cursor=reverted.cursor).asset_events == []  # once
