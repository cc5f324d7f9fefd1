"""The extraction driver against a loopback server whose /generate runs the real dump hook.

The fake server stands where the patched SGLang stands: for each request it runs
`TinyLoopModel` (test_dump_hook) over ForwardBatch-shaped extends, optionally in
prefill chunks, with a `HiddenStateDumper` writing the chunk files; so both
sides of the file boundary are the production code.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import orjson
import pytest
import torch

from eagle3_dagster.hidden.sharding import plan_shards
from eagle3_dagster.hidden.dataset import HiddenStatesDataset
from eagle3_dagster.hidden.shards import load_manifest
from eagle3_dagster.sglang.driver import DriverSettings, DumpError, extract_shard_sglang
from eagle3_dagster.sglang.dump_hook import HiddenStateDumper
from test_dump_hook import TinyLoopModel, extend_batch

LAYERS = [1, 2, 4]


class FakeSGLang:
    def __init__(self, dump_dir: Path, chunk: int | None = None, cached_tokens: int = 0, drop: str | None = None):
        self.model = TinyLoopModel()
        self.dumper = HiddenStateDumper(dump_dir, LAYERS, rank_fn=lambda: 0)
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                ids, rid = body["input_ids"], body["rid"]
                step = chunk or len(ids)
                with fake.lock:
                    if rid != drop:
                        for start in range(0, len(ids), step):
                            flat, pos, batch = extend_batch([(rid, ids[start : start + step], start)])
                            fake.model(flat, pos, batch, fake.dumper, "collector")
                meta = {"id": rid, "prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": cached_tokens}
                out = orjson.dumps({"text": "", "output_ids": [], "meta_info": meta})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def merged_train(tmp_path) -> Path:
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "merged_train.jsonl"
    with open(path, "wb") as f:
        for k, n in enumerate([5, 17, 1, 9, 12]):
            ids = torch.randint(1, 50, (n,), generator=g).tolist()
            rec = {"id": f"B1_sharegpt/conv{k}/0", "input_ids": ids, "loss_mask": [k % 2] * n}
            f.write(orjson.dumps(rec) + b"\n")
    return path


def _run(tmp_path, merged_train, server_kwargs=None, **settings):
    dump_dir = tmp_path / "dumps"
    server = FakeSGLang(dump_dir, **(server_kwargs or {}))
    try:
        spec = plan_shards(merged_train, samples_per_shard=100)[0]
        result = extract_shard_sglang(
            DriverSettings(base_url=server.url, dump_dir=dump_dir, concurrency=3, **settings),
            merged_train,
            spec,
            tmp_path / "v1",
            aux_layers=LAYERS,
            hidden_size=8,
            dtype="float32",
            target_identity="tiny-test",
        )
    finally:
        server.close()
    return server, result, dump_dir


@pytest.mark.parametrize("chunk", [None, 4])
def test_shard_holds_reference_states_of_every_sample_whole_or_chunked(tmp_path, merged_train, chunk):
    server, result, dump_dir = _run(tmp_path, merged_train, {"chunk": chunk})
    assert not result.skipped and result.num_samples == 5 and result.num_tokens == 44
    assert all(r["sampling_params"] == {"max_new_tokens": 0} for r in server.requests)
    ds = HiddenStatesDataset(tmp_path / "v1")
    assert ds.metadata["aux_layers"] == LAYERS and ds.metadata["code_version"] == "sglang-1"
    records = [orjson.loads(line) for line in merged_train.read_bytes().splitlines()]
    for item, rec in zip(ds, records, strict=True):
        ref = server.model.reference_states(rec["input_ids"])
        assert item["sample_id"] == rec["id"] and item["input_ids"].tolist() == rec["input_ids"]
        torch.testing.assert_close(item["aux_hidden"], torch.cat([ref[i] for i in LAYERS], -1))
        torch.testing.assert_close(item["last_hidden"], ref[-1])
        assert item["loss_mask"].tolist() == rec["loss_mask"]
    assert list(dump_dir.iterdir()) == []  # chunk files are removed once the shard is committed


def test_completed_shard_is_skipped_on_resume(tmp_path, merged_train):
    _, first, _ = _run(tmp_path, merged_train)
    server, again, _ = _run(tmp_path, merged_train)
    assert again.skipped and again.sha256 == first.sha256 and server.requests == []


def test_prefix_cache_hit_is_an_error_naming_the_sample(tmp_path, merged_train):
    with pytest.raises(DumpError, match="disable-radix-cache"):
        _run(tmp_path, merged_train, {"cached_tokens": 3})
    assert load_manifest(tmp_path / "v1") == {}


def test_missing_dump_fails_naming_the_sample_and_commits_nothing(tmp_path, merged_train):
    # The dumper's writer thread lands the other samples' files after their responses, one at a time, as
    # SGLang's does: the wait must cover that on a loaded machine (0.3 s did not), only the dropped one pays it.
    with pytest.raises(DumpError, match=r"'B1_sharegpt/conv3/0': no complete dump .* after 3s"):
        _run(tmp_path, merged_train, {"drop": "B1_sharegpt/conv3/0"}, dump_wait_s=3)
    assert load_manifest(tmp_path / "v1") == {}
    assert not any(p.suffix == ".safetensors" for p in (tmp_path / "v1").iterdir())


def write_driver_plan(merged_train: Path, version_dir, staging_dir: Path | None = None):
    """A plan file as extraction_plan writes it, for a target of hidden size 8 dumped at LAYERS, 3 samples
    per shard; returns its path (the driver reads everything about a shard from it)."""
    from eagle3_dagster.hidden.extraction_plan import ExtractionPlan, write_plan
    from eagle3_dagster.hidden.shards import ShardFormat
    from eagle3_dagster.target import TargetFacts

    fmt = ShardFormat(
        hidden_size=8, dtype="bfloat16", aux_layers=tuple(LAYERS), target_identity="t", code_version="sglang-1"
    )
    target = TargetFacts(
        path=Path("/unused"), identity="t", num_layers=5, hidden_size=8, vocab_size=50, aux_layers=tuple(LAYERS)
    )
    version_dir = str(version_dir)
    plan = ExtractionPlan(
        target,
        plan_shards(merged_train, samples_per_shard=3),
        fmt,
        version_dir.rsplit("/", 1)[-1],
        version_dir,
        merged_train,
        staging_dir=staging_dir,
    )
    return write_plan(plan)


def test_cli_extracts_the_named_shard_of_the_plan(tmp_path, merged_train):
    from eagle3_dagster.hidden.extraction_plan import load_plan
    from eagle3_dagster.sglang.driver import dump_folder, main

    plan_path = write_driver_plan(merged_train, tmp_path / "v1")
    server = FakeSGLang(dump_folder(load_plan(plan_path)))
    try:
        rc = main(["--plan", str(plan_path), "--shard", "shard-00001", "--base-url", server.url])
    finally:
        server.close()
    assert rc == 0
    assert list(load_manifest(tmp_path / "v1")) == ["shard-00001"]
    assert len(server.requests) == 2
    ds = HiddenStatesDataset(tmp_path / "v1")
    assert ds.metadata["aux_layers"] == LAYERS and ds.metadata["dtype"] == "bfloat16"
    assert ds.metadata["target_identity"] == "t"
    assert main(["--plan", str(plan_path), "--shard", "shard-00009", "--base-url", server.url]) == 2


def test_shard_failing_its_checksum_is_extracted_again_not_trusted(tmp_path, merged_train):
    """One flipped byte keeps the size the manifest records: resume must check the sha256, not the size."""
    _, first, _ = _run(tmp_path, merged_train)
    data = bytearray(first.path.read_bytes())
    data[-3] ^= 0xFF
    first.path.write_bytes(bytes(data))
    server, again, _ = _run(tmp_path, merged_train)
    assert not again.skipped and again.reextracted_corrupt
    assert len(server.requests) == 5  # every sample prefilled again
    assert again.sha256 == first.sha256 and first.path.read_bytes() != bytes(data)
