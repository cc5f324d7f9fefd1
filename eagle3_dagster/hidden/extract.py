"""One extraction skeleton for every backend: resume, shard format, writer, result.

A backend (`extract_hf.hf_rows`, `sglang.driver.sglang_rows`) only turns a shard's
samples into `(sample, aux_hidden [T, 3H], last_hidden [T, H])` rows, in any order;
`extract_shard` owns everything else:
- resume: a shard is skipped only when its manifest entry exists *and* the file's
  size and sha256 match it; a shard that fails its checksum is extracted again (and
  said so), never trusted; `force=True` extracts it again even when complete (the
  commit below replaces it whole: its manifest goes first, the new file is renamed
  over the old one, the new manifest comes last);
- the shard format (`ShardFormat`, whose code version comes from the plan, so the
  bytes are exactly the ones the plan predicted) and the commit protocol
  (`ShardWriter`: temporary name, rename, manifest last);
- progress as (tokens done, tokens in the shard) and the `ShardResult`;
- stage, then publish: the shard is written and committed in the version's local
  folder (`Location.local_folder`: the version folder itself when it is local, a
  staging folder for an object store), then `publish_shard` makes it the version's.
  For a local version that is a no-op; for a store it uploads the shard, reads it
  back to check its sha256 and writes its manifest on the store last. A run killed
  mid-upload leaves no manifest on the store; the next run finds the shard complete
  in staging and only uploads it again (nothing is extracted twice).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_dagster import storage
from eagle3_dagster.hidden.sharding import SampleRecord, ShardSpec, read_shard_records
from eagle3_dagster.hidden.shards import (
    ShardCorruptError,
    ShardFormat,
    ShardWriter,
    is_shard_complete,
    load_shard_manifest,
    manifest_path,
    shard_path,
    verify_shard,
)

Progress = Callable[[int, int], None]  # (tokens done, tokens in the shard)
Rows = Iterator[tuple[SampleRecord, torch.Tensor, torch.Tensor]]
Backend = Callable[[list[SampleRecord]], Iterable[tuple[SampleRecord, torch.Tensor, torch.Tensor]]]


@dataclass(frozen=True)
class ShardResult:
    key: str
    path: storage.Location
    num_samples: int
    num_tokens: int
    num_bytes: int
    sha256: str
    seconds: float
    skipped: bool  # already complete and verified; nothing was computed
    reextracted_corrupt: bool = False  # a manifest entry existed but the file failed its checksum
    uploaded_from_staging: bool = False  # a store's shard found complete in staging: only uploaded, not computed


def verified_complete(version_dir: storage.Location | Path, spec: ShardSpec) -> tuple[bool, str | None]:
    """(complete, why not trusted): complete only if the manifest names the right samples and the bytes match it."""
    entry = load_shard_manifest(version_dir, spec.key)
    if entry is None or not is_shard_complete(version_dir, spec.key, spec.sample_ids):
        return False, (None if entry is None else f"shard {spec.key}: file does not match its manifest entry")
    try:
        verify_shard(shard_path(version_dir, spec.key), entry)
    except ShardCorruptError as e:
        return False, str(e)
    return True, None


def extract_shard(
    spec: ShardSpec,
    merged_train: Path,
    version_dir: storage.Location | Path | str,
    fmt: ShardFormat | Callable[[], ShardFormat],
    backend: Backend,
    *,
    vocab_size: int | None | Callable[[], int | None] = None,
    progress: Progress | None = None,
    log: Callable[[str], None] = lambda _line: None,
    staging_dir: Path | None = None,
    force: bool = False,
) -> ShardResult:
    """Extract one shard through `backend` unless its manifest and bytes say it is already complete
    (`force`: even then).

    `fmt` and `vocab_size` may be callables, asked only when the shard has to be computed (a complete
    shard is skipped without reading the model directory). `staging_dir` is the local folder shards are
    written in before they are published, one subfolder per version (`ExtractionPlan.staging_dir`); a
    version on a store needs it."""
    start = time.perf_counter()
    version_dir = storage.location(version_dir)
    staged = version_dir.local_folder(None if staging_dir is None else Path(staging_dir) / version_dir.name)
    apart = storage.location(staged) != version_dir  # written in a staging folder, then published elsewhere
    complete, distrust = verified_complete(version_dir, spec)
    if complete and not force:
        if apart:
            _remove_staged(staged, spec.key)  # left by a run killed after its manifest went up
        return _result(spec, version_dir, _entry(version_dir, spec.key), 0.0, skipped=True)
    if distrust:
        log(f"{distrust}; extracting it again")
    elif complete:
        # ShardWriter deletes the manifest before it writes a byte, so for the length of the extraction the
        # shard counts as missing (never as complete with a half-written file); the old file stays in place
        # until the new one is renamed over it.
        log(f"shard {spec.key}: complete in {version_dir}, extracting it again (force)")
    in_staging, staged_distrust = verified_complete(staged, spec) if apart and not force else (False, None)
    if in_staging:
        log(f"shard {spec.key}: complete in staging {staged} (an upload was interrupted), uploading it again")
    else:
        if staged_distrust:
            log(f"{staged_distrust}; extracting it again")
        _write(spec, merged_train, staged, fmt, backend, vocab_size=vocab_size, progress=progress)
    entry = publish_shard(staged, version_dir, spec.key, log=log)
    return _result(
        spec,
        version_dir,
        entry,
        time.perf_counter() - start,
        skipped=False,
        reextracted_corrupt=distrust is not None or staged_distrust is not None,
        uploaded_from_staging=in_staging,
    )


def publish_shard(
    staged: Path, version_dir: storage.Location | Path | str, key: str, *, log: Callable[[str], None]
) -> dict:
    """Make the shard committed in the local folder `staged` the version's; its manifest entry.

    A local version is its own staging folder: nothing to do. On a store the manifest goes up only after the
    object's bytes, read back from the store, hash to the manifest's sha256; the staged copy is then deleted."""
    entry, version_dir = _entry(staged, key), storage.location(version_dir)
    if storage.location(staged) == version_dir:  # a local version is its own staging folder
        return entry
    manifest_path(version_dir, key).remove()  # an old entry must not vouch for the bytes being replaced
    log(f"shard {key}: uploading {entry['bytes']} bytes to {version_dir}")
    shard_path(version_dir, key).upload_file(Path(shard_path(staged, key)), entry["sha256"])
    manifest_path(version_dir, key).write_json(entry)
    _remove_staged(staged, key)
    return entry


def _remove_staged(staged: Path, key: str) -> None:
    for p in (manifest_path(staged, key), shard_path(staged, key)):  # manifest first: never a bare entry
        Path(p).unlink(missing_ok=True)


def _write(spec: ShardSpec, merged_train: Path, folder: Path, fmt, backend: Backend, *, vocab_size, progress) -> None:
    """The shard's rows from `backend`, committed with its manifest in the local `folder` by `ShardWriter`."""
    fmt = fmt() if callable(fmt) else fmt
    records = read_shard_records(merged_train, spec, vocab_size=vocab_size() if callable(vocab_size) else vocab_size)
    done = 0
    with ShardWriter(folder, spec.key, fmt, spec.sample_ids, spec.lengths, first_record=spec.first_record) as w:
        for sample, aux, last in backend(records):
            w.write_sample(
                sample.id,
                input_ids=torch.tensor(sample.input_ids, dtype=torch.int64),
                loss_mask=torch.tensor(sample.loss_mask, dtype=torch.uint8),
                aux_hidden=aux,
                last_hidden=last,
            )
            done += len(sample.input_ids)
            if progress is not None:
                progress(done, spec.num_tokens)


def _entry(folder: storage.Location | Path, key: str) -> dict:
    """The manifest entry of a shard known to be complete in `folder`."""
    if (entry := load_shard_manifest(folder, key)) is None:
        raise FileNotFoundError(f"shard {key}: no manifest entry in {folder}")
    return entry


def _result(
    spec: ShardSpec,
    version_dir: storage.Location,
    entry: dict,
    seconds: float,
    *,
    skipped: bool,
    reextracted_corrupt: bool = False,
    uploaded_from_staging: bool = False,
) -> ShardResult:
    return ShardResult(
        key=spec.key,
        path=shard_path(version_dir, spec.key),
        num_samples=entry["num_samples"],
        num_tokens=entry["num_tokens"],
        num_bytes=entry["bytes"],
        sha256=entry["sha256"],
        seconds=seconds,
        skipped=skipped,
        reextracted_corrupt=reextracted_corrupt,
        uploaded_from_staging=uploaded_from_staging,
    )
