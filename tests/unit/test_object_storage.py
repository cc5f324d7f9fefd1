"""hidden.root on an object store: shards staged locally, uploaded, checked by re-reading, then recorded.

The store is a real S3-compatible server (moto's, a separate thread serving HTTP on loopback) reached
through s3fs with credentials and endpoint from the environment, as in production; nothing is mocked
between the engine and the HTTP requests. The tests that extract from the micro target are in the full
tier (`scripts/test.sh`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3_dagster import storage
from eagle3_dagster.hidden.extract import publish_shard, verified_complete
from eagle3_dagster.hidden.estimate import cleanup_superseded, find_versions, estimate_extraction
from eagle3_dagster.hidden.sharding import plan_shards
from eagle3_dagster.hidden.dataset import HiddenStatesDataset
from eagle3_dagster.hidden.shards import (
    ShardCorruptError,
    ShardFormat,
    ShardWriter,
    load_manifest,
    verify_shard,
)
from tests.child_process import kill_when_it_says
from tests.unit import test_extract_hf as extract_hf_test
from tests.unit.test_export import _drafter, target_dir  # noqa: F401  (target_dir is a fixture)
from eagle3_dagster.stages.hidden import ExtractSettings, PlanSettings, ShardSettings
from eagle3_dagster.stages.train import TrainSettings

AUX, BATCH_TOKENS, LENGTHS, SAMPLES_PER_SHARD = (
    extract_hf_test.AUX,
    extract_hf_test.BATCH_TOKENS,
    extract_hf_test.LENGTHS,
    extract_hf_test.SAMPLES_PER_SHARD,
)

VERSION = "hs-000000000000"


@pytest.fixture(scope="module")
def s3_server():
    """A moto S3 server on a free loopback port; the environment points s3fs at it (no other network)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        fs, _ = storage.filesystem("s3://eagle3-test")
        fs.mkdir("eagle3-test")
        yield env
    server.stop()


def _extract(micro_target: Path, merged: Path, version_dir, staging: Path | None = None):
    return extract_hf_test._extract(micro_target, merged, version_dir, staging_dir=staging)


def _store_files(url: str) -> dict[str, bytes]:
    names = sorted(storage.location(url).file_sizes())
    return dict(zip(names, storage.read_many([storage.location(url).join(n) for n in names]), strict=True))


@pytest.fixture(scope="module")
def reference(micro_target, tmp_path_factory):
    """The same shards extracted to a local folder: what every store copy must equal byte for byte."""
    root = tmp_path_factory.mktemp("store_reference")
    merged = extract_hf_test._merged_train(root / "merged_train.jsonl", vocab=512)
    local = root / "hidden" / VERSION
    _extract(micro_target, merged, local)
    return merged, local


@pytest.fixture(scope="module")
def on_store(s3_server, micro_target, reference, tmp_path_factory):
    merged, _ = reference
    staging = tmp_path_factory.mktemp("staging")
    url = f"s3://eagle3-test/extracted/{VERSION}"
    results = _extract(micro_target, merged, url, staging)
    return url, staging, results


@pytest.mark.slow  # extracts from the micro target
def test_extraction_to_the_store_writes_the_bytes_a_local_run_writes(reference, on_store):
    _, local = reference
    url, staging, results = on_store
    assert [r.key for r in results] == ["shard-00000", "shard-00001", "shard-00002"]
    assert not any(r.skipped for r in results) and all(str(r.path).startswith("s3://") for r in results)
    assert _store_files(url) == {p.name: p.read_bytes() for p in sorted(local.iterdir())}
    assert not any(p.is_file() for p in staging.rglob("*"))  # staged shards are deleted once uploaded


@pytest.mark.slow  # extracts from the micro target
def test_plan_of_a_store_checks_the_staging_space_for_one_shard_in_flight(reference, on_store, tmp_path):
    merged, _ = reference
    url, _, _ = on_store
    specs = plan_shards(merged, SAMPLES_PER_SHARD)
    fmt = ShardFormat(
        hidden_size=64, dtype="float32", aux_layers=tuple(AUX), target_identity="micro", code_version="hf-1"
    )
    fresh = estimate_extraction(
        specs,
        fmt,
        "s3://eagle3-test/empty",
        VERSION,
        throughput_tokens_per_s=100.0,
        staging_dir=tmp_path,
        free_bytes=10**9,
    )
    sizes = storage.location(url).file_sizes()
    largest = max(sizes[f"{s.key}.safetensors"] + sizes[f"{s.key}.manifest.json"] for s in specs)
    assert fresh.needed_bytes == largest < fresh.remaining_bytes == fresh.total_bytes
    assert fresh.free_at == str(tmp_path) and fresh.fits
    short = estimate_extraction(
        specs,
        fmt,
        "s3://eagle3-test/empty",
        VERSION,
        throughput_tokens_per_s=100.0,
        staging_dir=tmp_path,
        free_bytes=largest - 1,
    )
    assert not short.fits and "staging folder" in short.message
    done = estimate_extraction(
        specs,
        fmt,
        storage.location(url).parent,
        VERSION,
        throughput_tokens_per_s=100.0,
        staging_dir=tmp_path,
        free_bytes=0,
    )
    assert done.remaining_bytes == 0 and done.needed_bytes == 0 and done.fits


@pytest.mark.slow  # extracts from the micro target
def test_training_reads_from_the_store_exactly_the_tensors_of_a_local_copy(reference, on_store, monkeypatch):
    _, local = reference
    url, _, _ = on_store
    remote, mapped = HiddenStatesDataset(url), HiddenStatesDataset(local)
    assert remote.metadata == mapped.metadata and remote.lengths() == mapped.lengths() == LENGTHS
    requested: list[int] = []
    real = storage.Location.read_ranges

    def counting(loc, ranges):
        requested.extend(end - start for start, end in ranges)
        return real(loc, ranges)

    monkeypatch.setattr(storage.Location, "read_ranges", counting)
    for i in range(len(mapped)):
        requested.clear()
        a, b = remote[i], mapped[i]
        assert a.keys() == b.keys() and a["sample_id"] == b["sample_id"]
        for k in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (i, k)
        # only this sample's rows travel: (ids 8 + mask 1 + 4 states of 64 float32) bytes per token
        assert sum(requested) == LENGTHS[i] * (8 + 1 + 4 * 64 * 4)


def test_fp8_shards_read_from_the_store_equal_the_local_read(s3_server, tmp_path):
    fmt = ShardFormat(
        hidden_size=8, dtype="float8_e4m3fn", aux_layers=(1, 2, 3), target_identity="t", code_version="hf-1"
    )
    g = torch.Generator().manual_seed(1)
    lengths = [4, 7, 1]
    ids = [f"s/{i}" for i in range(len(lengths))]
    with ShardWriter(tmp_path / "stage", "shard-00000", fmt, ids, lengths) as w:
        for sid, n in zip(ids, lengths, strict=True):
            w.write_sample(
                sid,
                input_ids=torch.arange(n),
                loss_mask=torch.ones(n, dtype=torch.uint8),
                aux_hidden=torch.randn(n, 24, generator=g),
                last_hidden=torch.randn(n, 8, generator=g),
            )
    local = tmp_path / "local"
    local.mkdir()
    for p in (tmp_path / "stage").iterdir():
        (local / p.name).write_bytes(p.read_bytes())
    url = "s3://eagle3-test/fp8/hs-00000000000f"
    publish_shard(tmp_path / "stage", url, "shard-00000", log=lambda _line: None)
    remote, mapped = HiddenStatesDataset(url), HiddenStatesDataset(local)
    for i in range(len(lengths)):
        for k in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            assert torch.equal(remote[i][k], mapped[i][k]) and remote[i][k].dtype == mapped[i][k].dtype


@pytest.mark.slow  # extracts from the micro target
def test_a_corrupted_object_on_the_store_is_refused_and_extracted_again(s3_server, micro_target, reference, tmp_path):
    merged, local = reference
    url = f"s3://eagle3-test/corrupt/{VERSION}"
    _extract(micro_target, merged, url, tmp_path)
    shard = storage.location(url).join("shard-00001.safetensors")
    good = shard.read_bytes()
    flipped = bytearray(good)
    flipped[-5] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(flipped))
    spec = plan_shards(merged, SAMPLES_PER_SHARD)[1]
    complete, why = verified_complete(url, spec)
    assert not complete and "sha256" in why and "shard-00001" in why
    with pytest.raises(ShardCorruptError, match="shard-00001"):
        verify_shard(shard, load_manifest(url)["shard-00001"])
    results = _extract(micro_target, merged, url, tmp_path)
    assert [(r.skipped, r.reextracted_corrupt) for r in results] == [(True, False), (False, True), (True, False)]
    assert shard.read_bytes() == good == (local / "shard-00001.safetensors").read_bytes()


def test_cleanup_deletes_superseded_versions_on_the_store(s3_server, tmp_path):
    root = storage.location("s3://eagle3-test/cleanup")
    for version in ("hs-aaaaaaaaaaaa", "hs-bbbbbbbbbbbb"):
        root.join(version, "shard-00000.safetensors").write_bytes(b"x" * 10)
    root.join("not-a-version", "keep.txt").write_bytes(b"y")
    assert [(v.version, v.num_bytes) for v in find_versions(root, "hs-bbbbbbbbbbbb")] == [("hs-aaaaaaaaaaaa", 10)]
    dry = cleanup_superseded(root, "hs-bbbbbbbbbbbb", dry_run=True, log=lambda _line: None)
    assert dry.freed_bytes == 10 and root.subfolders() == ["hs-aaaaaaaaaaaa", "hs-bbbbbbbbbbbb", "not-a-version"]
    cleanup_superseded(root, "hs-bbbbbbbbbbbb", dry_run=False, log=lambda _line: None)
    assert root.subfolders() == ["hs-bbbbbbbbbbbb", "not-a-version"]


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAEXAMPLE:supersecret@bucket/hidden",
        # an AWS secret key with a '/' in it: URL parsers read 'AKIAEXAMPLE:super' as the host, and the '@' as
        # part of the path (a location from the `eagle3` command line, not the profile, reached this unchecked)
        "s3://AKIAEXAMPLE:super/secret@bucket/hidden",
        "s3://bucket/hidden?X-Amz-Signature=supersecret",
    ],
)
def test_a_url_carrying_credentials_is_refused_without_echoing_them(url):
    with pytest.raises(ValueError, match="credential") as e:
        storage.location(url)
    assert "supersecret" not in str(e.value) and "secret@" not in str(e.value) and "AKIAEXAMPLE" not in str(e.value)


_CHILD = """
import sys, threading
from pathlib import Path
from eagle3_dagster import storage
from eagle3_dagster.hidden.extract_hf import extract_all_hf

real_upload, uploads = storage.Location.upload_file, []

def upload(loc, local, expected_sha256):
    uploads.append(loc)
    if len(uploads) == 2:
        # shard-00001: put half its bytes where the object goes (what a store that shows partial writes
        # would hold), say so, and wait there for the kill, so it lands mid-upload whatever the speed
        data = Path(local).read_bytes()
        loc.write_bytes(data[: len(data) // 2])
        print("mid-upload", flush=True)
        threading.Event().wait()
    real_upload(loc, local, expected_sha256)

storage.Location.upload_file = upload
extract_all_hf(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], samples_per_shard={sps}, aux_layers={aux},
               dtype="float32", batch_tokens={bt}, target_identity="micro", device="cpu", staging_dir=Path(sys.argv[4]))
"""


@pytest.mark.slow
def test_upload_killed_mid_way_resumes_by_uploading_only_what_is_missing(s3_server, micro_target, reference, tmp_path):
    merged, local = reference
    url = f"s3://eagle3-test/killed/{VERSION}"
    staging = tmp_path / "staging"
    code = _CHILD.format(sps=SAMPLES_PER_SHARD, aux=AUX, bt=BATCH_TOKENS)
    kill_when_it_says(
        code, [str(micro_target), str(merged), url, str(staging)], "mid-upload", "before uploading shard-00001"
    )
    assert sorted(load_manifest(url)) == ["shard-00000"]  # the half object is not vouched for
    assert storage.location(url).join("shard-00001.safetensors").size() is not None
    results = _extract(micro_target, merged, url, staging)
    assert [(r.skipped, r.uploaded_from_staging) for r in results] == [(True, False), (False, True), (False, False)]
    assert _store_files(url) == {p.name: p.read_bytes() for p in sorted(local.iterdir())}
    assert not any(p.is_file() for p in staging.rglob("*"))


def test_drafter_export_published_to_the_store_comes_back_identical_and_checked(s3_server, tmp_path, target_dir):
    from eagle3_dagster.drafter.export import export_drafter
    from eagle3_dagster.drafter.publish import EXPORT_MANIFEST, fetch_export, publish_export

    export = export_drafter(_drafter(target_dir), tmp_path / "run" / "export", serving_context=4096)
    dest = "s3://eagle3-test/drafters/run-0123456789ab"
    lines: list[str] = []
    manifest = publish_export(export, dest, log=lines.append)
    assert sorted(manifest["files"]) == sorted(p.name for p in export.iterdir())
    assert publish_export(export, dest, log=lines.append) == manifest and lines[-1].endswith(
        f"already published at {dest}"
    )
    back = fetch_export(dest, tmp_path / "fetched")
    assert {p.name: p.read_bytes() for p in back.iterdir()} == {p.name: p.read_bytes() for p in export.iterdir()}

    weights = storage.location(dest).join("model.safetensors")
    good = weights.read_bytes()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(ValueError, match="model.safetensors.*published export is corrupted"):
        fetch_export(dest, tmp_path / "corrupt")
    assert not (tmp_path / "corrupt" / "model.safetensors").exists()  # nothing failing its checksum is kept
    storage.location(dest).join(EXPORT_MANIFEST).remove()  # a publish that died before its manifest
    with pytest.raises(FileNotFoundError, match="did not finish"):
        fetch_export(dest, tmp_path / "unfinished")


@pytest.mark.slow  # extracts from the micro target
def test_plan_and_extract_stages_on_a_store_root(s3_server, micro_target, reference, tmp_path):
    import shutil

    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import PLAN_PATH_KEY, ArtifactLayout
    from eagle3_dagster.stages.hidden import cleanup_stage, extract_stage, plan_stage

    merged, _ = reference
    profile = load_profile(
        "micro",
        overrides={
            "run_root": str(tmp_path / "run"),
            "hidden": {"root": "s3://eagle3-test/stages/", "samples_per_shard": 3},
        },
    )
    layout = ArtifactLayout.from_profile(profile)
    shutil.copytree(micro_target, layout.target_dir)
    layout.merged_train.parent.mkdir(parents=True)
    shutil.copyfile(merged, layout.merged_train)
    report, fits, message = plan_stage(PlanSettings.from_profile(profile), layout, free_bytes=None)
    meta = report.metadata
    assert fits and meta["free_at"] == str(layout.staging_dir) == str(tmp_path / "run" / "hidden_staging")
    plan_path = meta[PLAN_PATH_KEY]
    assert plan_path == f"s3://eagle3-test/stages/{meta['version']}/plan.json" and storage.location(plan_path).exists()
    keys = [f"shard-0000{i}" for i in range(meta["num_shards"])]
    extracted, checks = extract_stage(ExtractSettings.from_profile(profile), plan_path, keys)
    assert all(passed for passed, _ in checks.values()), checks
    assert extracted.metadata["bytes_written"] == meta["total_bytes"]
    again, _ = extract_stage(ExtractSettings.from_profile(profile), plan_path, keys)
    assert again.metadata["resumed_shards"] == len(keys)
    storage.location("s3://eagle3-test/stages/hs-0123456789ab/shard-00000.safetensors").write_bytes(b"old")
    cleaned = cleanup_stage(
        ShardSettings.from_profile(profile), layout, dry_run=False, plan_path=plan_path, log=lambda _line: None
    )
    assert [v["version"] for v in cleaned.metadata["removed"]] == ["hs-0123456789ab"]
    assert storage.location("s3://eagle3-test/stages").subfolders() == [meta["version"]]


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"run_root": "s3://bucket/run"}, "run_root"),
        ({"hidden": {"root": "s3://bucket/hidden", "staging_dir": "s3://bucket/staging"}}, "hidden.staging_dir"),
        ({"hidden": {"root": "s3://AKIAEXAMPLE:supersecret@bucket/hidden"}}, "hidden.root"),
        ({"train": {"export_location": "s3://AKIAEXAMPLE:supersecret@bucket/drafters"}}, "train.export_location"),
    ],
)
def test_storage_fields_are_checked_when_the_profile_loads(overrides, field):
    from eagle3_dagster.config import ProfileError, load_profile

    with pytest.raises(ProfileError, match=rf"\b{field}: ") as e:
        load_profile("micro", overrides=overrides)
    assert "supersecret" not in str(e.value)


def test_a_store_root_plans_its_staging_folder_under_run_root_by_default():
    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import ArtifactLayout
    from eagle3_dagster.stages.hidden import free_space_location

    profile = load_profile("micro", overrides={"run_root": "/data/run", "hidden": {"root": "s3://bucket/hidden/"}})
    layout = ArtifactLayout.from_profile(profile)
    assert (
        str(layout.hidden_root) == "s3://bucket/hidden"
        and str(layout.hidden_version_dir("hs-1")) == "s3://bucket/hidden/hs-1"
    )
    assert free_space_location(layout) == Path("/data/run/hidden_staging")
    local = ArtifactLayout.from_profile(load_profile("micro", overrides={"hidden": {"root": "/data/hidden"}}))
    assert free_space_location(local) == Path("/data/hidden") == Path(local.hidden_root)


def test_finished_training_publishes_its_checked_export_to_the_export_location(s3_server, tmp_path, target_dir):
    import orjson

    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import ArtifactLayout
    from eagle3_dagster.drafter.export import export_drafter
    from eagle3_dagster.drafter.publish import fetch_export
    from eagle3_dagster.stages.train import TrainLaunch, finish_training

    profile = load_profile(
        "micro",
        overrides={"run_root": str(tmp_path / "run"), "train": {"export_location": "s3://eagle3-test/drafters"}},
    )
    run = tmp_path / "run" / "drafter" / "run-0123456789ab"
    export_drafter(_drafter(target_dir), run / "export", serving_context=4096)
    final = {"loss": 1.0, "sim_accept_length": 1.5, "acc_0": 0.5}
    (run / "metrics.json").write_bytes(
        orjson.dumps({"final": final, "steps": 3, "tokens_per_s": 10.0, "curves": {"loss": [1.0], "acc_0": [0.5]}})
    )
    plan = TrainLaunch(command=[], env={}, cwd=str(tmp_path), job_path=run / "job.json", out_dir=run)
    report, ok, _ = finish_training(TrainSettings.from_profile(profile), ArtifactLayout.from_profile(profile), plan)
    assert ok and report.metadata["export_location"] == "s3://eagle3-test/drafters/run-0123456789ab"
    back = fetch_export(report.metadata["export_location"], tmp_path / "fetched")
    assert {p.name: p.read_bytes() for p in back.iterdir()} == {
        p.name: p.read_bytes() for p in (run / "export").iterdir()
    }


def test_the_sglang_driver_publishes_to_the_store_the_bytes_it_writes_to_a_local_folder(s3_server, tmp_path):
    """The SGLang backend with hidden.root on S3, through the driver's command line as the GPU host runs it
    (loopback server running the real dump hook): the store holds the bytes the same driver writes to a local
    folder, only the shard asked for, and the staging folder is emptied once it is uploaded."""
    from eagle3_dagster.hidden.extraction_plan import load_plan
    from eagle3_dagster.sglang.driver import dump_folder, main
    from tests.unit.test_sglang_driver import FakeSGLang, write_driver_plan

    merged = extract_hf_test._merged_train(tmp_path / "merged_train.jsonl", vocab=50)
    local, url = tmp_path / "local" / VERSION, f"s3://eagle3-test/sglang/{VERSION}"
    for version_dir in (str(local), url):
        plan = write_driver_plan(merged, version_dir, staging_dir=tmp_path / "staging")
        server = FakeSGLang(dump_folder(load_plan(plan)))  # the local folder shards are written in, as the stage does
        try:
            assert main(["--plan", str(plan), "--shard", "shard-00001", "--base-url", server.url]) == 0
        finally:
            server.close()
    assert sorted(load_manifest(url)) == ["shard-00001"]
    shards = {n: b for n, b in _store_files(url).items() if n != "plan.json"}  # each plan names its own folders
    assert shards == {p.name: p.read_bytes() for p in sorted(local.iterdir()) if p.name != "plan.json"}
    assert not any(p.is_file() for p in (tmp_path / "staging").rglob("*"))
