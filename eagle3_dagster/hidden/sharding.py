"""Which samples of `merged_train.jsonl` go into which shard, and the version id of a run.

Owns: the split of merged_train (in file order) into fixed-size shards whose keys
are the `hidden_states` partition keys, validation of every record on the way
(bad input is an error naming the sample id and the file), and the short
hidden-state version id that names a version folder. Reading a shard's records
back is cheap: each `ShardSpec` keeps the byte offset of its first record.

Backends (hf, sglang) and the shard file format live elsewhere (`extract_hf`,
`shards`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

SHARD_KEY_PREFIX = "shard-"


def shard_key(index: int) -> str:
    return f"{SHARD_KEY_PREFIX}{index:05d}"


def shard_count(num_records: int, samples_per_shard: int) -> int:
    """How many shards `plan_shards` cuts `num_records` records into: full shards of `samples_per_shard`, the last
    one holding the rest. merged_train reports it, and the hidden_states partitions are registered from it before
    the plan is written."""
    return -(-num_records // samples_per_shard)


@dataclass(frozen=True)
class ShardSpec:
    """One shard = `num_records` consecutive records of merged_train starting at `first_record`."""

    key: str
    index: int
    first_record: int
    num_records: int
    num_tokens: int
    byte_offset: int  # where the first record's line starts in merged_train.jsonl
    sample_ids: tuple[str, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class SampleRecord:
    """A validated merged_train record, as the extraction backends consume it."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]


def _validate(rec: dict, where: str, *, max_seq_len: int | None, vocab_size: int | None) -> SampleRecord:
    sid = rec.get("id")
    if not isinstance(sid, str) or not sid:
        raise ValueError(f"{where}: record has no string 'id'")
    ids = rec.get("input_ids")
    mask = rec.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise ValueError(f"{where}: sample {sid!r} needs list fields 'input_ids' and 'loss_mask'")
    if not ids:
        raise ValueError(f"{where}: sample {sid!r} is empty (no input_ids)")
    if len(mask) != len(ids):
        raise ValueError(f"{where}: sample {sid!r} has {len(ids)} input_ids but {len(mask)} loss_mask entries")
    if max_seq_len is not None and len(ids) > max_seq_len:
        raise ValueError(f"{where}: sample {sid!r} has {len(ids)} tokens, more than max_seq_len={max_seq_len}")
    lo, hi = min(ids), max(ids)
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        bad = lo if lo < 0 else hi
        raise ValueError(f"{where}: sample {sid!r} has token id {bad} outside the vocabulary [0, {vocab_size})")
    if any(m not in (0, 1) for m in mask):
        raise ValueError(f"{where}: sample {sid!r} has a loss_mask value other than 0/1")
    return SampleRecord(id=sid, input_ids=ids, loss_mask=mask)


def _iter_lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, line) for every non-blank line."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, offset, line
            offset += len(line)


def _parse(path: Path, lineno: int, line: bytes) -> dict:
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not a JSON record ({e})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{path}:{lineno}: a record must be a JSON object")
    return rec


def plan_shards(
    merged_train: Path,
    samples_per_shard: int,
    *,
    max_seq_len: int | None = None,
    vocab_size: int | None = None,
) -> list[ShardSpec]:
    """Stream merged_train once, validating every record, and cut it into shards in file order.

    File order (merged_train is already shuffled) keeps shard contents stable for
    a given merged_train, which is what makes a shard key a durable partition.
    """
    if samples_per_shard < 1:
        raise ValueError(f"hidden.samples_per_shard must be >= 1, got {samples_per_shard}")
    merged_train = Path(merged_train)
    specs: list[ShardSpec] = []
    seen: set[str] = set()
    ids: list[str] = []
    lengths: list[int] = []
    first_offset = 0
    n = 0

    def flush() -> None:
        index = len(specs)
        specs.append(
            ShardSpec(
                key=shard_key(index),
                index=index,
                first_record=n - len(ids),
                num_records=len(ids),
                num_tokens=sum(lengths),
                byte_offset=first_offset,
                sample_ids=tuple(ids),
                lengths=tuple(lengths),
            )
        )
        ids.clear()
        lengths.clear()

    for lineno, offset, line in _iter_lines(merged_train):
        rec = _validate(
            _parse(merged_train, lineno, line),
            f"{merged_train}:{lineno}",
            max_seq_len=max_seq_len,
            vocab_size=vocab_size,
        )
        if rec.id in seen:
            raise ValueError(f"{merged_train}:{lineno}: sample id {rec.id!r} appears more than once")
        seen.add(rec.id)
        if not ids:
            first_offset = offset
        ids.append(rec.id)
        lengths.append(len(rec.input_ids))
        n += 1
        if len(ids) == samples_per_shard:
            flush()
    if ids:
        flush()
    if not specs:
        raise ValueError(f"{merged_train}: no records")
    return specs


def read_shard_records(
    merged_train: Path,
    spec: ShardSpec,
    *,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
) -> list[SampleRecord]:
    """The shard's records, read from its byte offset; checked against the spec so a changed file is caught."""
    merged_train = Path(merged_train)
    out: list[SampleRecord] = []
    with open(merged_train, "rb") as f:
        f.seek(spec.byte_offset)
        while len(out) < spec.num_records:
            line = f.readline()
            if not line:
                break
            if not line.strip():
                continue
            where = f"{merged_train} (record {spec.first_record + len(out)})"
            rec = _validate(_parse(merged_train, 0, line), where, max_seq_len=max_seq_len, vocab_size=vocab_size)
            expected = spec.sample_ids[len(out)]
            if rec.id != expected or len(rec.input_ids) != spec.lengths[len(out)]:
                raise ValueError(
                    f"{where}: expected sample {expected!r} with {spec.lengths[len(out)]} tokens for {spec.key}, "
                    f"found {rec.id!r} with {len(rec.input_ids)}; merged_train changed since the shards were planned"
                )
            out.append(rec)
    if len(out) != spec.num_records:
        raise ValueError(f"{merged_train}: {spec.key} expects {spec.num_records} records, file ended after {len(out)}")
    return out


def hidden_version(
    target_identity: str,
    merged_train_sha: str,
    aux_layers: Sequence[int],
    dtype: str,
    backend_code_version: str,
    *,
    samples_per_shard: int,
    batch_tokens: int | None = None,
) -> str:
    """A short stable id for everything that changes shard bytes; a new id means a new version folder.

    samples_per_shard is part of it because it changes which samples a shard key
    holds: mixing shards cut two ways under one folder would corrupt the set.
    batch_tokens (hf backend) changes the padded batch shapes, hence the kernels and
    the floating-point bytes of the states.
    """
    payload = orjson.dumps(
        {
            "aux_layers": [int(i) for i in aux_layers],
            "backend_code_version": backend_code_version,
            "dtype": dtype,
            "merged_train_sha256": merged_train_sha,
            "samples_per_shard": int(samples_per_shard),
            "target_identity": target_identity,
            **({"batch_tokens": int(batch_tokens)} if batch_tokens is not None else {}),
        },
        option=orjson.OPT_SORT_KEYS,
    )
    return "hs-" + hashlib.sha256(payload).hexdigest()[:12]
