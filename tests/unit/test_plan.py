"""The extraction estimate: exact bytes, time, free space, superseded versions and their opt-in cleanup."""

from __future__ import annotations

import os

import pytest
import torch

from eagle3_dagster.hidden.estimate import (
    TIB,
    actual_bytes,
    cleanup_superseded,
    find_versions,
    estimate_extraction,
)
from eagle3_dagster.hidden.sharding import ShardSpec, shard_key
from eagle3_dagster.hidden.shards import ShardFormat, ShardWriter

CURRENT = "hs-aaaaaaaaaaaa"
OLD = "hs-bbbbbbbbbbbb"


def _specs(lengths: list[int], per_shard: int) -> list[ShardSpec]:
    specs, first = [], 0
    for index, start in enumerate(range(0, len(lengths), per_shard)):
        chunk = lengths[start : start + per_shard]
        specs.append(
            ShardSpec(
                key=shard_key(index),
                index=index,
                first_record=first,
                num_records=len(chunk),
                num_tokens=sum(chunk),
                byte_offset=0,
                sample_ids=tuple(f"B3_dataset/{first + j}" for j in range(len(chunk))),
                lengths=tuple(chunk),
            )
        )
        first += len(chunk)
    return specs


def _write(version_dir, spec: ShardSpec, fmt: ShardFormat) -> None:
    with ShardWriter(version_dir, spec.key, fmt, spec.sample_ids, spec.lengths, first_record=spec.first_record) as w:
        for sid, n in zip(spec.sample_ids, spec.lengths):
            w.write_sample(
                sid,
                input_ids=torch.zeros(n, dtype=torch.long),
                loss_mask=torch.ones(n),
                aux_hidden=torch.ones(n, 3 * fmt.hidden_size),
                last_hidden=torch.ones(n, fmt.hidden_size),
            )


def test_production_scale_is_four_point_six_tib():
    """87.8 M tokens at hidden 7168 in bf16 (the seed's merged_train) need 4.6 TiB."""
    fmt = ShardFormat(
        hidden_size=7168,
        dtype="bfloat16",
        aux_layers=(2, 30, 58),
        target_identity="kimi-k2.5@x",
        code_version="sglang-1",
    )
    num_samples, tokens = 21_436, 87_800_000
    lengths = [tokens // num_samples] * num_samples
    lengths[-1] += tokens - sum(lengths)
    specs = _specs(lengths, 128)
    estimate = estimate_extraction(specs, fmt, "/nonexistent/root", CURRENT, throughput_tokens_per_s=350, free_bytes=0)
    assert estimate.num_tokens == tokens and estimate.num_shards == 168
    assert round(estimate.total_bytes / TIB, 1) == 4.6
    per_token = 4 * 7168 * 2 + 8 + 1  # 3 aux + last states in bf16 (56 KiB), an int64 id, a uint8 mask
    per_shard_overhead = (estimate.total_bytes - tokens * per_token) / estimate.num_shards
    assert 0 < per_shard_overhead < 64 * 1024  # header, offsets and manifest: small next to the states
    assert estimate.estimated_hours == pytest.approx(tokens / 350 / 3600)
    assert not estimate.fits and "short by 4.6 TiB" in estimate.message


def test_predicted_bytes_equal_bytes_written(tmp_path):
    fmt = ShardFormat(hidden_size=8, dtype="bfloat16", aux_layers=(1, 2, 3), target_identity="t", code_version="c")
    specs = _specs([3, 1, 7, 2, 5, 11, 4], 3)
    for spec in specs:
        _write(tmp_path / CURRENT, spec, fmt)
    estimate = estimate_extraction(
        specs, fmt, tmp_path / "elsewhere", CURRENT, throughput_tokens_per_s=1.0, free_bytes=10**9
    )
    assert estimate.total_bytes == actual_bytes(tmp_path / CURRENT, [s.key for s in specs])


def test_completed_shards_are_not_counted_as_remaining(tmp_path):
    fmt = ShardFormat(hidden_size=4, dtype="float32", aux_layers=(1, 2, 3), target_identity="t", code_version="c")
    specs = _specs([4, 4, 4, 4], 2)
    _write(tmp_path / CURRENT, specs[0], fmt)
    estimate = estimate_extraction(specs, fmt, tmp_path, CURRENT, throughput_tokens_per_s=2.0, free_bytes=10**9)
    assert estimate.remaining_tokens == 8
    assert estimate.remaining_bytes == estimate.total_bytes - actual_bytes(tmp_path / CURRENT, [specs[0].key])
    assert estimate.estimated_hours == pytest.approx(8 / 2.0 / 3600)


def test_free_space_is_measured_where_the_shards_go(tmp_path):
    fmt = ShardFormat(hidden_size=4, dtype="float32", aux_layers=(1, 2, 3), target_identity="t", code_version="c")
    estimate = estimate_extraction(_specs([4], 1), fmt, tmp_path / "not" / "yet", CURRENT, throughput_tokens_per_s=1.0)
    assert estimate.free_bytes == os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert estimate.fits


def _version(root, name, size):
    d = root / name
    d.mkdir(parents=True)
    (d / "shard-00000.safetensors").write_bytes(b"x" * size)
    return d


def test_a_plan_that_does_not_fit_says_by_how_much_and_what_could_be_freed(tmp_path):
    fmt = ShardFormat(hidden_size=4, dtype="float32", aux_layers=(1, 2, 3), target_identity="t", code_version="c")
    _version(tmp_path, OLD, 20000)
    specs = _specs([100], 1)
    estimate = estimate_extraction(specs, fmt, tmp_path, CURRENT, throughput_tokens_per_s=1.0, free_bytes=1000)
    assert not estimate.fits
    assert [v.version for v in estimate.superseded] == [OLD] and estimate.superseded_bytes == 20000
    assert (
        f"short by {(estimate.remaining_bytes - 1000) / 1024:.1f} KiB" in estimate.message
        and OLD in estimate.message
        and "(enough)" in estimate.message
    )


def test_find_versions_lists_only_superseded_version_folders(tmp_path):
    _version(tmp_path, CURRENT, 10)
    _version(tmp_path, OLD, 300)
    (tmp_path / "notes").mkdir()
    (tmp_path / "hs-cccccccccccc").symlink_to(tmp_path / OLD)
    found = find_versions(tmp_path, CURRENT)
    assert [(v.version, v.num_bytes) for v in found] == [(OLD, 300)]


def test_cleanup_is_a_dry_run_by_default_and_logs_every_path(tmp_path):
    _version(tmp_path, CURRENT, 10)
    old = _version(tmp_path, OLD, 300)
    lines: list[str] = []
    result = cleanup_superseded(tmp_path, CURRENT, log=lines.append)
    assert result.dry_run and result.freed_bytes == 300 and old.exists()
    assert any(str(old) in line and "300 bytes" in line for line in lines)


def test_cleanup_deletes_only_superseded_versions_and_never_follows_links(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(b"keep")
    root = tmp_path / "root"
    current = _version(root, CURRENT, 10)
    old = _version(root, OLD, 300)
    (old / "link_out").symlink_to(outside)
    (root / "hs-dddddddddddd").symlink_to(outside)
    result = cleanup_superseded(root, CURRENT, dry_run=False, log=lambda _: None)
    assert [v.version for v in result.removed] == [OLD] and not old.exists()
    assert current.exists() and (outside / "precious.bin").read_bytes() == b"keep"
    assert (root / "hs-dddddddddddd").is_symlink()


def test_byte_counts_read_in_binary_units_from_bytes_to_pib():
    from eagle3_dagster.hidden.estimate import human_bytes

    assert [human_bytes(n) for n in (None, 512, 1536, 87_800_000 * 4 * 7168 * 2, 5 * 2**50)] == [
        "unknown",
        "512 B",
        "1.5 KiB",
        "4.6 TiB",
        "5.0 PiB",
    ]
