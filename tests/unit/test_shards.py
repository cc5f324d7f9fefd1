"""Shard format, writer commit protocol, manifests, reader, and the sharding of merged_train."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3_dagster.hidden.sharding import hidden_version, plan_shards, read_shard_records
from eagle3_dagster.hidden.dataset import HiddenStatesDataset
from eagle3_dagster.hidden.shards import (
    ShardCorruptError,
    ShardFormat,
    ShardWriter,
    is_shard_complete,
    load_manifest,
    load_shard_manifest,
    manifest_path,
    shard_path,
    verify_shard,
)
from eagle3_dagster.io import write_jsonl

H = 4
FMT = ShardFormat(hidden_size=H, dtype="bfloat16", aux_layers=(1, 2, 3), target_identity="tiny@abc", code_version="t-1")


def _sample(sid: str, n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "id": sid,
        "input_ids": torch.randint(0, 100, (n,), generator=g),
        "loss_mask": torch.randint(0, 2, (n,), generator=g),
        "aux_hidden": torch.randn(n, 3 * H, generator=g),
        "last_hidden": torch.randn(n, H, generator=g),
    }


def _write(version_dir: Path, key: str, samples: list[dict], order=None) -> dict:
    ids, lengths = [s["id"] for s in samples], [len(s["input_ids"]) for s in samples]
    with ShardWriter(version_dir, key, FMT, ids, lengths) as w:
        for s in order if order is not None else samples:
            w.write_sample(s["id"], **{k: v for k, v in s.items() if k != "id"})
    return w.entry


SAMPLES = [_sample("ds/a", 3, 0), _sample("ds/b", 5, 1), _sample("ds/c", 1, 2)]


def test_reader_returns_each_sample_as_written(tmp_path):
    _write(tmp_path, "shard-00000", SAMPLES)
    ds = HiddenStatesDataset(tmp_path)
    assert len(ds) == 3 and ds.lengths() == [3, 5, 1]
    for i, s in enumerate(SAMPLES):
        got = ds[i]
        assert got["sample_id"] == s["id"]
        assert got["input_ids"].dtype == torch.long and torch.equal(got["input_ids"], s["input_ids"])
        assert got["loss_mask"].dtype == torch.long and torch.equal(got["loss_mask"], s["loss_mask"])
        assert got["aux_hidden"].dtype == torch.bfloat16
        assert torch.equal(got["aux_hidden"], s["aux_hidden"].bfloat16())
        assert torch.equal(got["last_hidden"], s["last_hidden"].bfloat16())
    assert ds.metadata == {
        "format_version": 1,
        "target_identity": "tiny@abc",
        "aux_layers": [1, 2, 3],
        "aux_layer_numbering": "hf_output_hidden_states_index",
        "dtype": "bfloat16",
        "hidden_size": H,
        "last_hidden_post_norm": True,
        "code_version": "t-1",
    }


def test_shard_is_a_valid_safetensors_file_with_offsets_and_sample_ids(tmp_path):
    _write(tmp_path, "shard-00000", SAMPLES)
    tensors = load_file(shard_path(tmp_path, "shard-00000"))
    assert tensors["offsets"].tolist() == [0, 3, 8, 9]
    assert tensors["aux_hidden"].shape == (9, 3 * H) and tensors["last_hidden"].shape == (9, H)
    assert tensors["loss_mask"].dtype == torch.uint8 and tensors["input_ids"].dtype == torch.int64
    with safe_open(str(shard_path(tmp_path, "shard-00000")), framework="pt") as f:
        meta = f.metadata()
    assert orjson.loads(meta["sample_ids"]) == ["ds/a", "ds/b", "ds/c"]
    assert meta["last_hidden_post_norm"] == "true" and meta["aux_layer_numbering"] == "hf_output_hidden_states_index"


def test_write_order_does_not_change_shard_bytes(tmp_path):
    e1 = _write(tmp_path / "v1", "shard-00000", SAMPLES)
    e2 = _write(tmp_path / "v2", "shard-00000", SAMPLES, order=[SAMPLES[2], SAMPLES[0], SAMPLES[1]])
    assert e1 == e2
    assert (
        shard_path(tmp_path / "v1", "shard-00000").read_bytes()
        == shard_path(tmp_path / "v2", "shard-00000").read_bytes()
    )
    assert (
        manifest_path(tmp_path / "v1", "shard-00000").read_bytes()
        == manifest_path(tmp_path / "v2", "shard-00000").read_bytes()
    )


def test_manifest_maps_sample_to_rows_and_checksum(tmp_path):
    entry = _write(tmp_path, "shard-00000", SAMPLES)
    assert [s["rows"] for s in entry["samples"]] == [[0, 3], [3, 8], [8, 9]]
    assert entry["bytes"] == Path(shard_path(tmp_path, "shard-00000")).stat().st_size
    verify_shard(shard_path(tmp_path, "shard-00000"), entry)


def test_failed_write_leaves_no_shard_and_no_manifest(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(tmp_path, "shard-00000", FMT, ["x"], [2]) as w:
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    assert not w.tmp_path.exists()


def test_incomplete_shard_refuses_to_commit(tmp_path):
    w = ShardWriter(tmp_path, "shard-00000", FMT, ["a", "b"], [1, 1])
    s = _sample("a", 1, 0)
    w.write_sample("a", **{k: v for k, v in s.items() if k != "id"})
    with pytest.raises(ValueError, match="1 samples never written"):
        w.close()
    w.abort()
    assert not shard_path(tmp_path, "shard-00000").exists()


def test_write_sample_rejects_wrong_shape_and_unknown_id(tmp_path):
    w = ShardWriter(tmp_path, "shard-00000", FMT, ["a"], [2])
    s = _sample("a", 3, 0)
    with pytest.raises(ValueError, match="'a' input_ids has shape"):
        w.write_sample("a", **{k: v for k, v in s.items() if k != "id"})
    with pytest.raises(KeyError, match="'zzz' does not belong"):
        w.write_sample("zzz", **{k: v for k, v in s.items() if k != "id"})
    w.abort()


def test_resume_trusts_the_manifest_not_the_file(tmp_path):
    _write(tmp_path, "shard-00000", SAMPLES)
    assert is_shard_complete(tmp_path, "shard-00000", [s["id"] for s in SAMPLES])
    Path(manifest_path(tmp_path, "shard-00000")).unlink()  # crash between rename and manifest
    assert shard_path(tmp_path, "shard-00000").exists()
    assert not is_shard_complete(tmp_path, "shard-00000")
    _write(tmp_path, "shard-00000", SAMPLES[:2])
    assert not is_shard_complete(tmp_path, "shard-00000", [s["id"] for s in SAMPLES])  # different samples


def test_rewriting_a_shard_drops_its_old_manifest_before_replacing_the_file(tmp_path):
    _write(tmp_path, "shard-00000", SAMPLES)
    w = ShardWriter(tmp_path, "shard-00000", FMT, ["a"], [1])
    assert not manifest_path(tmp_path, "shard-00000").exists()
    w.abort()


def test_a_dead_writers_temp_is_removed_and_another_hosts_live_temp_on_a_shared_root_is_kept(tmp_path, monkeypatch):
    import socket

    here = socket.gethostname()
    stale = tmp_path / f".shard-00000.safetensors.{here}-999999999.tmp"  # a writer on this host, killed
    stale.write_bytes(b"partial")
    # a writer on another host sharing hidden.root, still writing: its pid means nothing on this host
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node-7")
    there = ShardWriter(tmp_path, "shard-00000", FMT, ["x"], [1])
    os.close(there._fd)
    monkeypatch.undo()
    assert there.tmp_path.exists()

    _write(tmp_path, "shard-00000", SAMPLES)
    assert there.tmp_path.exists()  # untouched: the other host renames it when it finishes
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [there.tmp_path.name, "shard-00000.safetensors", manifest_path(tmp_path, "shard-00000").name]
    )


def test_verify_shard_names_the_corrupted_shard(tmp_path):
    entry = _write(tmp_path, "shard-00007", SAMPLES)
    path = shard_path(tmp_path, "shard-00007")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardCorruptError, match="shard-00007.*sha256"):
        verify_shard(path, entry)
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(ShardCorruptError, match="shard-00007.*bytes on disk"):
        verify_shard(path, entry)


def test_manifests_of_shards_finished_in_any_order_aggregate(tmp_path):
    _write(tmp_path, "shard-00001", [_sample("s/3", 2, 3)])
    _write(tmp_path, "shard-00000", SAMPLES)
    (tmp_path / ".shard-00002.safetensors.1.tmp").write_bytes(b"in flight")
    manifest = load_manifest(tmp_path)
    assert list(manifest) == ["shard-00000", "shard-00001"]
    ds = HiddenStatesDataset(tmp_path)
    assert ds.sample_ids == ["ds/a", "ds/b", "ds/c", "s/3"]
    assert HiddenStatesDataset(tmp_path, shard_keys=["shard-00001"]).lengths() == [2]
    with pytest.raises(FileNotFoundError, match="shard-00002"):
        HiddenStatesDataset(tmp_path, shard_keys=["shard-00002"])


def test_dataset_serves_spawned_dataloader_workers(tmp_path):
    """A worker started with spawn gets the dataset by value: open handles must not travel with it."""
    _write(tmp_path, "shard-00000", SAMPLES)
    ds = HiddenStatesDataset(tmp_path)
    ds[0]  # opens the shard in this process first
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    served = list(loader)
    assert [s["sample_id"] for s in served] == ds.sample_ids
    assert torch.equal(served[1]["aux_hidden"], ds[1]["aux_hidden"])


def test_shards_with_different_headers_are_refused_together(tmp_path):
    _write(tmp_path, "shard-00000", SAMPLES)
    other = ShardFormat(
        hidden_size=H, dtype="bfloat16", aux_layers=(1, 2, 3), target_identity="other", code_version="t-1"
    )
    with ShardWriter(tmp_path, "shard-00001", other, ["z"], [1]) as w:
        s = _sample("z", 1, 9)
        w.write_sample("z", **{k: v for k, v in s.items() if k != "id"})
    with pytest.raises(ValueError, match="shard-00001.*target_identity"):
        HiddenStatesDataset(tmp_path)


# --- sharding of merged_train -------------------------------------------------------------------


def _records(lengths: list[int]) -> list[dict]:
    return [
        {
            "id": f"ds/{i}",
            "dataset": "ds",
            "input_ids": [(i + j) % 50 for j in range(n)],
            "loss_mask": [j % 2 for j in range(n)],
        }
        for i, n in enumerate(lengths)
    ]


def test_plan_shards_cuts_merged_train_in_file_order(tmp_path):
    path = tmp_path / "merged_train.jsonl"
    write_jsonl(path, _records([3, 4, 5, 6, 7]))
    specs = plan_shards(path, 2)
    assert [s.key for s in specs] == ["shard-00000", "shard-00001", "shard-00002"]
    assert [(s.first_record, s.num_records, s.num_tokens) for s in specs] == [(0, 2, 7), (2, 2, 11), (4, 1, 7)]
    assert specs[1].sample_ids == ("ds/2", "ds/3") and specs[1].lengths == (5, 6)
    recs = read_shard_records(path, specs[1])
    assert [r.id for r in recs] == ["ds/2", "ds/3"] and recs[0].input_ids == _records([3, 4, 5])[2]["input_ids"]


def test_read_shard_records_detects_a_changed_merged_train(tmp_path):
    path = tmp_path / "merged_train.jsonl"
    write_jsonl(path, _records([3, 4, 5]))
    spec = plan_shards(path, 2)[1]
    write_jsonl(path, _records([3, 4, 6]))
    with pytest.raises(ValueError, match="merged_train changed"):
        read_shard_records(path, spec)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"id": "ds/empty", "input_ids": [], "loss_mask": []}, "'ds/empty' is empty"),
        (
            {"id": "ds/long", "input_ids": [1] * 9, "loss_mask": [0] * 9},
            "'ds/long' has 9 tokens, more than max_seq_len=8",
        ),
        (
            {"id": "ds/oov", "input_ids": [1, 100], "loss_mask": [0, 1]},
            "'ds/oov' has token id 100 outside the vocabulary",
        ),
        ({"id": "ds/neg", "input_ids": [-1], "loss_mask": [0]}, "'ds/neg' has token id -1"),
        ({"id": "ds/mask", "input_ids": [1, 2], "loss_mask": [1]}, "'ds/mask' has 2 input_ids but 1 loss_mask"),
    ],
)
def test_bad_samples_are_errors_naming_sample_and_file(tmp_path, record, message):
    path = tmp_path / "merged_train.jsonl"
    write_jsonl(path, _records([2]) + [record])
    with pytest.raises(ValueError, match=message) as e:
        plan_shards(path, 4, max_seq_len=8, vocab_size=100)
    assert str(path) in str(e.value) and ":2:" in str(e.value)


def test_duplicate_sample_ids_are_refused(tmp_path):
    path = tmp_path / "merged_train.jsonl"
    write_jsonl(path, _records([2]) + _records([3]))
    with pytest.raises(ValueError, match="'ds/0' appears more than once"):
        plan_shards(path, 4)


def test_hidden_version_is_short_stable_and_changes_with_each_input():
    base = dict(
        target_identity="t",
        merged_train_sha="m",
        aux_layers=[2, 30, 58],
        dtype="bfloat16",
        backend_code_version="hf-1",
        samples_per_shard=128,
    )
    v = hidden_version(**base)
    assert v == hidden_version(**base) and v.startswith("hs-") and len(v) == 15
    for k, other in [
        ("target_identity", "t2"),
        ("merged_train_sha", "m2"),
        ("aux_layers", [1, 30, 58]),
        ("dtype", "float32"),
        ("backend_code_version", "sglang-1"),
        ("samples_per_shard", 64),
    ]:
        assert hidden_version(**{**base, k: other}) != v, k


def test_engine_shard_writer_does_not_keep_file_descriptors_after_close(tmp_path):
    before = len(os.listdir("/proc/self/fd"))
    _write(tmp_path, "shard-00000", SAMPLES)
    assert len(os.listdir("/proc/self/fd")) == before


def test_fp8_shards_store_scaled_rows_in_about_half_the_bytes_of_bf16_exactly_as_predicted(tmp_path):
    from eagle3_dagster.hidden.dataset import HiddenStatesDataset
    from eagle3_dagster.hidden.shards import ShardFormat, ShardWriter, shard_file_size

    g = torch.Generator().manual_seed(0)
    ids, lens = ["a", "b", "c"], [5, 9, 3]
    # three aux layers of very different magnitude, as early, middle and late layers are
    rows = {
        sid: (
            torch.randn(n, 3 * 64, generator=g) * torch.repeat_interleave(torch.tensor([0.05, 2.0, 80.0]), 64),
            torch.randn(n, 64, generator=g),
        )
        for sid, n in zip(ids, lens)
    }
    sizes = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        fmt = ShardFormat(hidden_size=64, dtype=dtype, aux_layers=(2, 4, 6), target_identity="t", code_version="hf-1")
        with ShardWriter(tmp_path / dtype, "shard-00000", fmt, ids, lens) as w:
            for sid, n in zip(ids, lens):
                w.write_sample(
                    sid,
                    input_ids=torch.arange(n),
                    loss_mask=torch.ones(n, dtype=torch.uint8),
                    aux_hidden=rows[sid][0],
                    last_hidden=rows[sid][1],
                )
        sizes[dtype] = (tmp_path / dtype / "shard-00000.safetensors").stat().st_size
        assert sizes[dtype] == shard_file_size(fmt, "shard-00000", ids, lens)
        ds = HiddenStatesDataset(tmp_path / dtype)
        for i, sid in enumerate(ids):
            s = ds[i]
            assert s["aux_hidden"].dtype == torch.bfloat16
            for layer in range(3):  # per-row, per-layer scales: each layer keeps its own relative precision
                got, want = (
                    s["aux_hidden"].float()[:, layer * 64 : (layer + 1) * 64],
                    rows[sid][0][:, layer * 64 : (layer + 1) * 64],
                )
                assert (got - want).norm() / want.norm() < (0.05 if dtype == "float8_e4m3fn" else 0.01)
    # at Kimi-K2.5's hidden size the per-token bytes halve: 4·7168 fp8 + 16 scale bytes against 4·7168·2
    big = {
        d: shard_file_size(ShardFormat(7168, d, (2, 30, 58), "t", "sglang-1"), "s", ["x"], [1000])
        for d in ("bfloat16", "float8_e4m3fn")
    }
    assert 0.49 < big["float8_e4m3fn"] / big["bfloat16"] < 0.51


def test_a_corrupt_manifest_is_an_error_naming_its_file_and_what_to_do(tmp_path):
    _write(tmp_path, "shard-00000", SAMPLES)
    manifest = manifest_path(tmp_path, "shard-00000")
    manifest.write_bytes(manifest.read_bytes()[:40])  # cut off, as a full disk or a torn copy leaves it
    with pytest.raises(ValueError) as err:
        load_manifest(tmp_path)
    assert str(manifest) in str(err.value) and "extracted again" in str(err.value)
    with pytest.raises(ValueError, match=str(manifest)):
        load_shard_manifest(tmp_path, "shard-00000")


@pytest.mark.parametrize(
    "num_records,samples_per_shard", [(1, 1), (1, 8), (8, 8), (9, 8), (20, 8), (1005, 256), (7, 3)]
)
def test_the_registered_shard_count_is_the_number_of_shards_the_plan_cuts(tmp_path, num_records, samples_per_shard):
    """merged_train's num_shards registers the hidden_states partitions before the plan exists; the plan's shards
    must be exactly those (a partition that is not a shard of the plan is refused at run time)."""
    from eagle3_dagster.hidden.sharding import shard_count

    merged = tmp_path / "merged_train.jsonl"
    write_jsonl(merged, [{"id": f"s{i}", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]} for i in range(num_records)])
    assert len(plan_shards(merged, samples_per_shard)) == shard_count(num_records, samples_per_shard)
