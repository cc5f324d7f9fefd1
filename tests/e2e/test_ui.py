"""The micro pipeline as a user drives it: a real webserver + daemon, GraphQL, and headless Chromium.

The test starts `dagster dev` on loopback for the project's own code location
(workspace.yaml → definitions.py, EAGLE3_PROFILE = micro with outputs in a temp
folder), runs the demo's command (`scripts/run_pipeline.py`) up to the corpus
through it, as with `scripts/ui.sh` open, backfills a few hidden_states shard
partitions that the sensor registered from merged_train, then opens the UI in
Chromium and checks what it shows. Screenshots go to artifacts/.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from assets._common import OWNERS
from tests.e2e.conftest import REPO as REPO_ROOT
from eagle3_dagster.config import load_profile

pytestmark = pytest.mark.e2e

DATASETS = load_profile("micro").dataset_names
# The runs the demo's command submits for its stages up to the corpus, in order, as (job, partition key or None).
STAGE_RUNS: list[tuple[str, str | None]] = [
    ("target_job", None),  # target_model
    *[("data_job", ds) for ds in DATASETS],  # raw_responses + tokenized_dataset per dataset
    ("corpus_job", None),  # merged_train, vocab_mapping, extraction_plan (+ blocking fits_on_disk check)
]
# Shard partitions backfilled through launchPartitionBackfill; needs corpus_job (merged_train registers them).
BACKFILL_SHARDS = 2
# Launched after the backfill, on every registered shard.
FINAL_RUNS: list[tuple[str, str | None]] = [("train_job", None)]  # drafter_checkpoint, benchmark_report
RUN_TIMEOUT_S = 600

ASSET_NODES = """{ assetNodes { assetKey { path } groupName } }"""
LATEST_METADATA = """
query Latest($path: [String!]!) {
  assetOrError(assetKey: {path: $path}) {
    ... on Asset { assetMaterializations(limit: 1) { runId metadataEntries { __typename label
      ... on IntMetadataEntry { intValue } ... on FloatMetadataEntry { floatValue }
      ... on TextMetadataEntry { text } } } }
  }
}"""
SHARD_KEYS = """{ assetNodeOrError(assetKey: {path: ["hidden_states"]}) { ... on AssetNode { partitionKeys } } }"""
LAUNCH_BACKFILL = """
mutation Backfill($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message stack }
    ... on InvalidSubsetError { message }
    ... on UnauthorizedError { message }
  }
}"""
BACKFILL = """
query Backfill($id: String!) {
  partitionBackfillOrError(backfillId: $id) {
    __typename
    ... on PartitionBackfill { status numPartitions partitionNames runs { runId status tags { key value } } }
    ... on PythonError { message }
  }
}"""
BACKFILL_DONE = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED", "FAILING"}


def launch_and_wait(dep, job: str, partition: str | None) -> dict:
    tags = {"dagster/partition": partition} if partition else {}
    run_id = dep.submit(job, tags=tags)
    run = dep.wait_for_run(run_id, timeout_s=RUN_TIMEOUT_S)
    assert run["status"] == "SUCCESS", f"{job}[{partition}] {run['status']}:\n{dep.run_log(run_id)[-4000:]}"
    return run


def assets_by_group(dep) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for node in dep.graphql(ASSET_NODES)["assetNodes"]:
        groups.setdefault(node["groupName"], []).append("/".join(node["assetKey"]["path"]))
    return {g: sorted(names) for g, names in sorted(groups.items())}


def latest_metadata(dep, asset: str) -> dict:
    data = dep.graphql(LATEST_METADATA, {"path": [asset]})["assetOrError"]
    [event] = data["assetMaterializations"]
    return {e["label"]: e for e in event["metadataEntries"]}


RUNS = """{ runsOrError { ... on Runs { results { runId jobName status tags { key value } } } } }"""


@pytest.fixture(scope="module")
def stages_done(micro_deployment) -> list[dict]:
    """`scripts/run_pipeline.py --until corpus` (what scripts/demo.sh runs) while the UI serves the instance:
    it finds the UI's URL where scripts/ui.sh leaves it and submits each stage's runs through it."""
    from scripts.dagster_dev import UI_URL_FILE

    dep = micro_deployment
    (dep.home / UI_URL_FILE).write_text(dep.url)
    env = {**os.environ, "DAGSTER_HOME": str(dep.home), "EAGLE3_PROFILE": str(dep.home.parent / "micro.yaml")}
    proc = subprocess.run(
        [sys.executable, "scripts/run_pipeline.py", "--until", "corpus"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S * len(STAGE_RUNS),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"submitting through the UI at {dep.url}" in proc.stdout
    runs = list(reversed(dep.graphql(RUNS)["runsOrError"]["results"]))  # oldest first
    assert [
        (r["jobName"], {t["key"]: t["value"] for t in r["tags"]}.get("dagster/partition")) for r in runs
    ] == STAGE_RUNS
    return runs


@pytest.fixture(scope="module")
def target_built(micro_deployment) -> None:
    """The browser tests need only target_model; they must not wait on (or fail with) later stages."""
    data = micro_deployment.graphql(LATEST_METADATA, {"path": ["target_model"]})["assetOrError"]
    if not data.get("assetMaterializations"):
        launch_and_wait(micro_deployment, "target_job", None)


@pytest.fixture(scope="module")
def backfill(micro_deployment, stages_done) -> dict:
    dep = micro_deployment
    deadline = time.monotonic() + 120  # the sensor's minimum interval is 15 s
    while not (keys := dep.graphql(SHARD_KEYS)["assetNodeOrError"]["partitionKeys"]):
        assert time.monotonic() < deadline, "the sensor registered no hidden_states partitions from merged_train"
        time.sleep(1)
    chosen = keys[:BACKFILL_SHARDS]
    params = {"assetSelection": [{"path": ["hidden_states"]}], "partitionNames": chosen, "fromFailure": False}
    launched = dep.graphql(LAUNCH_BACKFILL, {"params": params})["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    deadline = time.monotonic() + RUN_TIMEOUT_S * BACKFILL_SHARDS
    while True:
        result = dep.graphql(BACKFILL, {"id": launched["backfillId"]})["partitionBackfillOrError"]
        if result["status"] in BACKFILL_DONE and all(
            r["status"] in ("SUCCESS", "FAILURE", "CANCELED") for r in result["runs"]
        ):
            break
        assert time.monotonic() < deadline, f"backfill not done after {RUN_TIMEOUT_S * BACKFILL_SHARDS} s: {result}"
        time.sleep(2)
    return {"keys": keys, "chosen": chosen, "result": result}


def test_the_demo_command_submits_every_stage_job_and_each_run_succeeds(stages_done):
    assert [r["status"] for r in stages_done] == ["SUCCESS"] * len(STAGE_RUNS)
    for run in stages_done:
        tags = {t["key"]: t["value"] for t in run["tags"]}
        assert tags.get("eagle3/profile") == "micro"


def test_the_jobs_and_overview_pages_list_the_demo_commands_runs(
    micro_deployment, stages_done, browser_page, artifacts_dir
):
    """Runs submitted through the code location are linked to their jobs: each job's Runs tab lists them, and
    the Overview's timeline shows them (in-process runs showed "No runs found" and "No runs or scheduled ticks")."""
    dep, page = micro_deployment, browser_page
    for job in dict.fromkeys(r["jobName"] for r in stages_done):
        short_ids = [r["runId"][:8] for r in stages_done if r["jobName"] == job]
        text = open_page(page, f"{dep.url}/locations/{dep.location_name}/jobs/{job}/runs", short_ids[0])
        page.screenshot(path=str(artifacts_dir / f"ui_job_runs_{job}.png"), full_page=True)
        assert "No runs found" not in text
        assert [i for i in short_ids if i not in text] == [], f"the {job} page does not list every run"
    text = open_page(page, f"{dep.url}/overview/activity/timeline", stages_done[0]["jobName"])
    page.screenshot(path=str(artifacts_dir / "ui_overview_timeline.png"), full_page=True)
    assert "No runs or scheduled ticks" not in text
    assert [r["jobName"] for r in stages_done if r["jobName"] not in text] == []


def test_sensor_registers_one_partition_per_merged_train_shard(micro_deployment, backfill):
    meta = latest_metadata(micro_deployment, "merged_train")
    assert backfill["keys"] == [f"shard-{i:05d}" for i in range(meta["num_shards"]["intValue"])]


def test_partition_backfill_over_shards_runs_one_successful_run_per_shard(micro_deployment, backfill):
    result = backfill["result"]
    assert result["numPartitions"] == BACKFILL_SHARDS
    by_partition = {
        next(t["value"] for t in r["tags"] if t["key"] == "dagster/partition"): r["status"] for r in result["runs"]
    }
    assert by_partition == {key: "SUCCESS" for key in backfill["chosen"]}, result


@pytest.fixture(scope="module")
def trained(micro_deployment, backfill) -> list[dict]:
    dep = micro_deployment
    for key in backfill["keys"][BACKFILL_SHARDS:]:
        launch_and_wait(dep, "extract_job", key)
    return [launch_and_wait(dep, job, partition) for job, partition in FINAL_RUNS]


def test_training_runs_after_every_shard_is_extracted(trained):
    assert [r["status"] for r in trained] == ["SUCCESS"] * len(FINAL_RUNS)


def test_every_metadata_key_on_every_asset_page_is_described_in_its_legend(micro_deployment, trained):
    from assets.metadata_legend import undescribed

    names = sorted(n for members in assets_by_group(micro_deployment).values() for n in members)
    gaps = {name: undescribed(name, latest_metadata(micro_deployment, name)) for name in names}
    assert gaps == {name: [] for name in names}


# ---- operating and auditing ----------------------------------------------------------------------

# The progress contract (eagle3_dagster.stages.ProgressMeter): label: done/total unit (pct), rate unit/s, ETA
PROGRESS = re.compile(r"^(\S+): ([\d,]+)/([\d,]+) (\w+) \((\d+\.\d)%\), ([\d.,]+) \4/s, ETA \d+:\d\d:\d\d")
CHECK_EXECUTIONS = """
query Checks($path: [String!]!, $check: String!) {
  assetCheckExecutions(assetKey: {path: $path}, checkName: $check, limit: 50) {
    partition status
    evaluation { partition severity metadataEntries { __typename label ... on IntMetadataEntry { intValue } } }
  }
}"""
STALENESS = """{ assetNodes { assetKey { path } isPartitioned staleStatus staleCauses { reason category } } }"""
STALE_PARTITIONS = """
query Partitions($path: [String!]!, $partitions: [String!]!) {
  assetNodeOrError(assetKey: {path: $path}) { ... on AssetNode { staleStatusByPartition(partitions: $partitions) } }
}"""
LATEST_OBSERVATION = """
query Observed($path: [String!]!) {
  assetOrError(assetKey: {path: $path}) {
    ... on Asset { assetObservations(limit: 1) { timestamp metadataEntries { __typename label
      ... on TextMetadataEntry { text } ... on IntMetadataEntry { intValue }
      ... on TableMetadataEntry { table { records } } } } }
  }
}"""
PARTITION_CHECK = """
query Check($path: [String!]!, $name: String!) {
  assetNodeOrError(assetKey: {path: $path}) { ... on AssetNode { assetCheckOrError(checkName: $name) {
    __typename ... on AssetCheck { executionForLatestMaterialization { status evaluation { success severity
      description metadataEntries { label ... on IntMetadataEntry { intValue }
        ... on TableMetadataEntry { table { records } } } } } } } } }
}"""
RELOAD = """
mutation Reload($name: String!) {
  reloadRepositoryLocation(repositoryLocationName: $name) {
    __typename ... on WorkspaceLocationEntry { loadStatus } ... on PythonError { message }
  }
}"""


def test_shard_runs_log_progress_by_the_contract_not_bare_numbers(micro_deployment, backfill):
    for run in backfill["result"]["runs"]:
        log = micro_deployment.run_log(run["runId"]).splitlines()
        lines = [line for line in log if PROGRESS.match(line) and PROGRESS.match(line).group(4) == "tokens"]
        assert lines, f"no progress line in run {run['runId']}:\n" + "\n".join(log[:40])
        assert not [line for line in log if re.fullmatch(r"\d+", line.strip())], "bare numbers in the run log"


def test_shard_checks_are_shown_per_partition_with_numbers(micro_deployment, backfill):
    for check in ["bytes_match_plan", "manifest_checksums"]:
        runs = micro_deployment.graphql(CHECK_EXECUTIONS, {"path": ["hidden_states"], "check": check})
        executions = runs["assetCheckExecutions"]
        assert {e["partition"] for e in executions} >= set(backfill["chosen"]), check
        assert all(e["status"] == "SUCCEEDED" and e["evaluation"]["severity"] == "ERROR" for e in executions)
        if check == "bytes_match_plan":
            numbers = [
                m for e in executions for m in e["evaluation"]["metadataEntries"] if m["label"] == "bytes_written"
            ]
            assert numbers and all(m["__typename"] == "IntMetadataEntry" and m["intValue"] > 0 for m in numbers)


def test_a_shard_launched_from_the_asset_page_runs_with_the_assets_limits_and_tags(micro_deployment, backfill):
    """The asset page launches `__ASSET_JOB`, which has no job tags: the asset puts its own on the run."""
    dep = micro_deployment
    run_id = dep.submit(
        "__ASSET_JOB", asset_selection=["hidden_states"], tags={"dagster/partition": backfill["chosen"][0]}
    )
    run = dep.wait_for_run(run_id, timeout_s=RUN_TIMEOUT_S)
    assert run["status"] == "SUCCESS", dep.run_log(run_id)[-4000:]
    tags = {t["key"]: t["value"] for t in run["tags"]}
    assert tags.get("eagle3/profile") == "micro"
    assert tags.get("dagster/max_runtime") == str(load_profile("micro").hidden.max_runtime_s)


def test_the_drafter_page_names_everything_that_produced_it(micro_deployment, trained, browser_page, artifacts_dir):
    dep, page = micro_deployment, browser_page
    meta = latest_metadata(dep, "drafter_checkpoint")
    audit = [
        "target_identity",
        "merged_train_sha256",
        "hidden_version",
        "shards",
        "git_sha",
        "code_version",
        "packages",
        "settings",
    ]
    assert [k for k in audit if k not in meta] == []
    text = open_page(page, f"{dep.url}/assets/drafter_checkpoint", "merged_train_sha256")
    page.screenshot(path=str(artifacts_dir / "ui_drafter_provenance.png"), full_page=True)
    assert [k for k in audit if k not in text] == []
    assert meta["hidden_version"]["text"] in text


def partition_verdict(dep, asset: str, wanted, timeout_s: float = 180) -> tuple[dict, dict[str, dict]]:
    """The asset's partitions_current verdict the UI shows (the one newer than the latest materialization), once
    `wanted` holds for it: the partition_status sensor reports it within its 30 s interval."""
    deadline = time.monotonic() + timeout_s
    while True:
        check = dep.graphql(PARTITION_CHECK, {"path": [asset], "name": "partitions_current"})
        execution = check["assetNodeOrError"]["assetCheckOrError"]["executionForLatestMaterialization"]
        evaluation = (execution or {}).get("evaluation")
        if evaluation:
            entries = {e["label"]: e for e in evaluation["metadataEntries"]}
            rows = {r["partition"]: r for r in map(json.loads, entries["not_current"]["table"]["records"])}
            if wanted(evaluation, rows):
                return evaluation, rows
        assert time.monotonic() < deadline, f"{asset}'s partitions_current never showed the verdict: {execution}"
        time.sleep(2)


def test_a_config_edit_marks_every_invalidated_asset_stale_and_names_the_setting(
    micro_deployment, trained, backfill, browser_page, artifacts_dir
):
    dep, page = micro_deployment, browser_page
    evaluation, _ = partition_verdict(dep, "hidden_states", lambda e, rows: e["success"])
    assert evaluation["description"] == f"all {len(backfill['keys'])} shards are current"
    partitions = {"hidden_states": backfill["keys"], "raw_responses": DATASETS, "tokenized_dataset": DATASETS}
    profile_path = dep.home.parent / "micro.yaml"
    original = profile_path.read_text()
    edited = yaml.safe_load(original)
    before = edited["data"]["max_seq_len"]
    edited["data"]["max_seq_len"] = before + 16
    profile_path.write_text(yaml.safe_dump(edited, sort_keys=False))
    try:
        reloaded = dep.graphql(RELOAD, {"name": dep.location_name})["reloadRepositoryLocation"]
        assert reloaded["__typename"] == "WorkspaceLocationEntry", reloaded
        status = {}
        for node in dep.graphql(STALENESS)["assetNodes"]:
            name = node["assetKey"]["path"][-1]
            if node["isPartitioned"]:  # Dagster computes staleness per partition only
                found = dep.graphql(STALE_PARTITIONS, {"path": [name], "partitions": partitions[name]})
                status[name] = set(found["assetNodeOrError"]["staleStatusByPartition"])
            else:
                status[name] = {node["staleStatus"]}
        expected = {name: {"STALE"} for name in status} | {"target_model": {"FRESH"}}
        assert status == expected

        # The changed_settings sensor (30 s interval) names the edit on each invalidated asset.
        deadline = time.monotonic() + 180
        while True:
            observed = dep.graphql(LATEST_OBSERVATION, {"path": ["drafter_checkpoint"]})["assetOrError"]
            entries = {e["label"]: e for obs in observed.get("assetObservations") or [] for e in obs["metadataEntries"]}
            if "changed_setting_names" in entries:
                break
            assert time.monotonic() < deadline, "changed_settings sensor reported nothing for drafter_checkpoint"
            time.sleep(2)
        assert entries["changed_setting_names"]["text"] == "data.max_seq_len"
        [row] = [json.loads(r) for r in entries["changed_settings"]["table"]["records"]]
        assert row == {"setting": "data.max_seq_len", "before": str(before), "after": str(before + 16)}

        open_page(page, f"{dep.url}/assets/drafter_checkpoint?view=events", "drafter_checkpoint")
        page.screenshot(path=str(artifacts_dir / "ui_changed_settings.png"), full_page=True)

        # Every partition Dagster calls STALE (each shard, each dataset of both dataset assets) is listed as
        # stale by its asset's partitions_current, with the cause, in the browser.
        for asset, keys in partitions.items():
            evaluation, rows = partition_verdict(dep, asset, lambda e, rows: not e["success"])
            found = dep.graphql(STALE_PARTITIONS, {"path": [asset], "partitions": keys})["assetNodeOrError"]
            stale = {k for k, s in zip(keys, found["staleStatusByPartition"]) if s == "STALE"}
            assert {k for k, r in rows.items() if r["status"] == "stale"} == stale == set(keys), asset
            assert evaluation["severity"] == "WARN" and all(
                "a setting it reads changed" in r["cause"] for r in rows.values()
            )
            open_page(page, f"{dep.url}/assets/{asset}?view=checks", "partitions_current")
            page.get_by_text("partitions_current", exact=True).first.click()  # as a user picks it from the list
            wait_for_text(page, evaluation["description"])
            page.wait_for_timeout(1000)
            page.screenshot(path=str(artifacts_dir / f"ui_partitions_current_{asset}.png"), full_page=True)
            text = page.inner_text("body")
            assert [k for k in keys if k not in text] == [], f"{asset}'s check page does not name every stale key"
        # and the asset's node in its group's graph counts the failed check
        open_page(page, f"{dep.url}/locations/{dep.location_name}/asset-groups/hidden_states", "hidden_states")
        wait_for_text(page, "2 / 3 Passed")
        page.screenshot(path=str(artifacts_dir / "ui_partitions_current_graph.png"), full_page=True)
        open_page(page, f"{dep.url}/asset-groups", "Global asset lineage")
        page.screenshot(path=str(artifacts_dir / "ui_stale_after_edit.png"), full_page=True)
    finally:
        profile_path.write_text(original)
        dep.graphql(RELOAD, {"name": dep.location_name})

    # The revert clears it: every partition is current again, on every partitioned asset.
    for asset, keys in partitions.items():
        evaluation, rows = partition_verdict(dep, asset, lambda e, rows: e["success"])
        noun = "shard" if asset == "hidden_states" else "dataset"
        done = f"all {len(keys)} {noun}s are current" if len(keys) > 1 else f"its only {noun} is current"
        assert rows == {} and evaluation["description"] == done, asset


# ---- the browser --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser_page(micro_deployment, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "the UI test needs Debian's chromium (apt-get install chromium); scripts/test.sh installs it"
    profile_dir = tmp_path_factory.mktemp("chromium-profile")
    args = [
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
    ]
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile_dir),
            executable_path=chromium,
            headless=True,
            args=args,
            viewport={"width": 1600, "height": 1000},
        )
        page = context.new_page()
        page.set_default_timeout(60_000)
        # The first visit opens a newsletter dialog over every page; answer it once, as a user would.
        page.goto(f"{micro_deployment.url}/overview")
        page.get_by_role("button", name="Skip").click(timeout=30_000)
        yield page
        context.close()


def wait_for_text(page, text: str, timeout_s: float = 60) -> None:
    page.get_by_text(text, exact=False).first.wait_for(state="attached", timeout=timeout_s * 1000)


def open_page(page, url: str, expect: str) -> str:
    """Go to `url`, wait for `expect` to render, return the page's text."""
    page.goto(url)
    wait_for_text(page, expect)
    page.wait_for_timeout(1000)  # graph layout and the last GraphQL answers
    return page.inner_text("body")


def test_ui_asset_catalog_and_graph_show_every_asset(micro_deployment, target_built, browser_page, artifacts_dir):
    dep, page = micro_deployment, browser_page
    groups = assets_by_group(dep)
    names = sorted(n for members in groups.values() for n in members)
    assert {"target_model", "merged_train", "hidden_states", "drafter_checkpoint"} <= set(names)

    catalog = open_page(page, f"{dep.url}/assets", names[0])
    page.screenshot(path=str(artifacts_dir / "ui_asset_catalog.png"), full_page=True)
    assert [n for n in names if n not in catalog] == [], "asset catalog is missing assets"

    lineage = open_page(page, f"{dep.url}/asset-groups", "Global asset lineage")
    page.screenshot(path=str(artifacts_dir / "ui_asset_lineage.png"), full_page=True)
    assert [g for g in groups if g not in lineage] == [], "global lineage is missing asset groups"
    for group, members in groups.items():
        graph = open_page(page, f"{dep.url}/locations/{dep.location_name}/asset-groups/{group}", members[0])
        page.screenshot(path=str(artifacts_dir / f"ui_asset_graph_{group}.png"), full_page=True)
        assert [n for n in members if n not in graph] == [], f"graph of group {group} is missing assets"


def test_ui_asset_page_shows_latest_materialization_metadata(
    micro_deployment, target_built, browser_page, artifacts_dir
):
    dep, page = micro_deployment, browser_page
    meta = latest_metadata(dep, "target_model")
    numeric = {
        k: e.get("intValue", e.get("floatValue"))
        for k, e in meta.items()
        if e["__typename"] in ("IntMetadataEntry", "FloatMetadataEntry")
    }
    assert numeric, f"target_model's materialization carries no numeric metadata: {sorted(meta)}"

    text = open_page(page, f"{dep.url}/assets/target_model", next(iter(numeric)))
    page.screenshot(path=str(artifacts_dir / "ui_target_model.png"), full_page=True)
    assert [k for k in meta if k not in text] == [], "asset page is missing metadata labels"
    # the owners (a team shows by its name) and the link to the function that defines the asset
    assert "Owners" in text and OWNERS[0].removeprefix("team:") in text
    assert re.search(r"Source code\s+Open\s+target_model\.py\s", text) and "in editor" in text
    for label, value in numeric.items():
        if isinstance(value, int):
            shown = {str(value), f"{value:,}"}
            assert any(s in text for s in shown), f"{label}={value} not shown on the asset page"
        else:
            assert re.search(re.escape(f"{value:.3g}"[:4]), text), f"{label}={value} not shown on the asset page"
