"""What a user sees when the code location starts and runs: no Beta/Preview noise, the console at INFO,
and every asset with its owners and the place in the code that defines it."""

from __future__ import annotations

import warnings
from pathlib import Path

import dagster as dg
import pytest
import yaml

from assets._common import OWNERS
from definitions import build_definitions
from eagle3_dagster.config import load_profile

REPO = Path(__file__).resolve().parents[2]
INSTANCE_CONFIGS = [REPO / "dagster_home" / "dagster.yaml", REPO / "deploy" / "postgres" / "dagster.yaml"]


@pytest.mark.parametrize("profile", ["micro", "demo", "production"])
def test_loading_the_code_location_raises_no_beta_or_preview_warning(profile):
    loaded = load_profile(profile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # pyproject's filterwarnings hides these from every other test
        build_definitions(loaded)
    noisy = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if issubclass(w.category, (dg.BetaWarning, dg.PreviewWarning))
    ]
    assert noisy == []


@pytest.mark.parametrize("config", INSTANCE_CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_run_console_shows_info_and_up_while_the_event_log_keeps_every_event(config, capfd):
    python_logs = yaml.safe_load(config.read_text())["python_logs"]

    @dg.asset
    def quiet(context) -> None:
        context.log.info("an info line")

    with dg.instance_for_test(overrides={"python_logs": python_logs}) as instance:
        result = dg.materialize([quiet], instance=instance)
        console = capfd.readouterr().err
        stored = {e.dagster_event_type.value for e in instance.all_logs(result.run_id) if e.is_dagster_event}
    assert "an info line" in console and " - DEBUG - " not in console
    assert {"STEP_START", "STEP_SUCCESS", "ASSET_MATERIALIZATION"} <= stored  # DEBUG events are still recorded


def test_every_asset_names_its_owners_and_the_code_that_defines_it():
    graph = build_definitions(load_profile("micro")).resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        refs = node.metadata.get("dagster/code_references")
        assert list(node.owners) == OWNERS, key
        assert refs and all(Path(r.file_path).is_relative_to(REPO / "assets") for r in refs.code_references), key
