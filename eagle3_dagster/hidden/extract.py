"""One extraction skeleton for every backend: resume, shard format, writer, result.

A backend (`extract_hf.hf_rows`, `sglang.driver.sglang_rows`) only turns a shard's
samples into `(sample, aux_hidden [T, 3H], last_hidden [T, H])` rows, in any order;
`extract_shard` owns everything else:
- resume: a shard is skipped only when its manifest entry exists *and* the file's
  size and sha256 match it; a shard that fails its checksum is extracted again (and
  said so), never trusted;
- the shard format (`ShardFormat`, whose code version comes from the plan, so the
  bytes are exactly the ones the plan predicted) and the commit protocol
  (`ShardWriter`: temporary name, rename, manifest last);
- progress as (tokens done, tokens in the shard) and the `ShardResult`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_dagster.hidden.sharding import SampleRecord, ShardSpec, read_shard_records
from eagle3_dagster.hidden.shards import (
    ShardCorruptError,
    ShardFormat,
    ShardWriter,
    is_shard_complete,
    load_shard_manifest,
    shard_path,
    verify_shard,
)

Progress = Callable[[int, int], None]  # (tokens done, tokens in the shard)
Rows = Iterator[tuple[SampleRecord, torch.Tensor, torch.Tensor]]
Backend = Callable[[list[SampleRecord]], Iterable[tuple[SampleRecord, torch.Tensor, torch.Tensor]]]


@dataclass(frozen=True)
class ShardResult:
    key: str
    path: Path
    num_samples: int
    num_tokens: int
    num_bytes: int
    sha256: str
    seconds: float
    skipped: bool  # already complete and verified; nothing was computed
    reextracted_corrupt: bool = False  # a manifest entry existed but the file failed its checksum


def verified_complete(version_dir: Path, spec: ShardSpec) -> tuple[bool, str | None]:
    """(complete, why not trusted): complete only if the manifest names the right samples and the bytes match it."""
    if not is_shard_complete(version_dir, spec.key, spec.sample_ids):
        entry = load_shard_manifest(version_dir, spec.key)
        return False, (None if entry is None else f"shard {spec.key}: file does not match its manifest entry")
    try:
        verify_shard(shard_path(version_dir, spec.key), load_shard_manifest(version_dir, spec.key))
    except ShardCorruptError as e:
        return False, str(e)
    return True, None


def extract_shard(
    spec: ShardSpec,
    merged_train: Path,
    version_dir: Path,
    fmt: ShardFormat | Callable[[], ShardFormat],
    backend: Backend,
    *,
    vocab_size: int | None | Callable[[], int | None] = None,
    progress: Progress | None = None,
    log: Callable[[str], None] = lambda _line: None,
) -> ShardResult:
    """Extract one shard through `backend` unless its manifest and bytes say it is already complete.

    `fmt` and `vocab_size` may be callables, asked only when the shard has to be computed (a complete
    shard is skipped without reading the model directory)."""
    start = time.perf_counter()
    version_dir = Path(version_dir)
    complete, distrust = verified_complete(version_dir, spec)
    if complete:
        entry = load_shard_manifest(version_dir, spec.key)
        return _result(spec, version_dir, entry, 0.0, skipped=True)
    if distrust:
        log(f"{distrust}; extracting it again")
    fmt = fmt() if callable(fmt) else fmt
    records = read_shard_records(merged_train, spec, vocab_size=vocab_size() if callable(vocab_size) else vocab_size)
    done = 0
    with ShardWriter(version_dir, spec.key, fmt, spec.sample_ids, spec.lengths, first_record=spec.first_record) as w:
        for sample, aux, last in backend(records):
            w.write_sample(sample.id, input_ids=torch.tensor(sample.input_ids, dtype=torch.int64),
                           loss_mask=torch.tensor(sample.loss_mask, dtype=torch.uint8),
                           aux_hidden=aux, last_hidden=last)
            done += len(sample.input_ids)
            if progress is not None:
                progress(done, spec.num_tokens)
    return _result(spec, version_dir, w.entry, time.perf_counter() - start, skipped=False,
                   reextracted_corrupt=distrust is not None)


def _result(spec: ShardSpec, version_dir: Path, entry: dict, seconds: float, *, skipped: bool,
            reextracted_corrupt: bool = False) -> ShardResult:
    return ShardResult(
        key=spec.key, path=shard_path(version_dir, spec.key), num_samples=entry["num_samples"],
        num_tokens=entry["num_tokens"], num_bytes=entry["bytes"], sha256=entry["sha256"], seconds=seconds,
        skipped=skipped, reextracted_corrupt=reextracted_corrupt,
    )
