"""`extract_shard(force=True)`: a shard complete in its manifest is extracted again and replaced whole.

A stand-in backend (deterministic rows from the sample ids) keeps this to the engine's resume and commit
protocol; tests/assets/test_hidden_gates.py runs the same switch from the launchpad on the micro target.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_dagster.hidden.extract import extract_shard
from eagle3_dagster.hidden.sharding import plan_shards
from eagle3_dagster.hidden.shards import ShardFormat, load_shard_manifest, manifest_path, shard_path
from eagle3_dagster.io import write_jsonl

H = 8


def test_force_replaces_a_complete_shard_with_a_new_file_of_the_same_bytes_and_never_a_stale_manifest(tmp_path):
    merged = tmp_path / "merged_train.jsonl"
    write_jsonl(
        merged,
        [
            {"id": f"s{i}", "dataset": "d", "input_ids": list(range(1, n + 1)), "loss_mask": [1] * n}
            for i, n in enumerate([3, 5, 4])
        ],
    )
    [spec] = plan_shards(merged, 8)
    fmt = ShardFormat(hidden_size=H, dtype="float32", aux_layers=(0, 1, 2), target_identity="t", code_version="c")
    version_dir = tmp_path / "hs"
    seen_manifest_during_compute: list[bool] = []

    def backend(records):
        seen_manifest_during_compute.append(manifest_path(version_dir, spec.key).exists())
        for r in records:
            n = len(r.input_ids)
            yield r, torch.full((n, 3 * H), float(n)), torch.full((n, H), float(n))

    first = extract_shard(spec, merged, version_dir, fmt, backend)
    path = Path(shard_path(version_dir, spec.key))
    before, data = path.stat(), path.read_bytes()

    skipped = extract_shard(spec, merged, version_dir, fmt, backend)
    assert skipped.skipped and path.stat().st_ino == before.st_ino and len(seen_manifest_during_compute) == 1

    forced = extract_shard(spec, merged, version_dir, fmt, backend, force=True)
    assert not forced.skipped and forced.sha256 == first.sha256
    assert seen_manifest_during_compute == [False, False]  # while computing, no manifest vouches for the shard
    assert path.stat().st_ino != before.st_ino and path.read_bytes() == data
    assert load_shard_manifest(version_dir, spec.key)["sha256"] == first.sha256
    assert not list(version_dir.glob(".*.tmp"))
