"""The extraction estimate: exact bytes, estimated hours, free space, superseded versions, and their cleanup.

Owns the numbers the `extraction_plan` asset shows and its blocking check uses (the plan itself, the shards
and where they go, is `hidden.extraction_plan.ExtractionPlan`).
Bytes are exact, not estimated: a shard's size is fully determined by its
samples and header (see `shards.encode_header`), and manifests are written
deterministically, so both are computed with the writer's own code. Deleting
superseded versions is a separate, explicit, logged step (`cleanup_superseded`),
dry-run unless asked otherwise.

Free bytes on a remote GPU host are measured by the host resource and passed in.
What must fit is measured where shards are written (`Location.local_folder`): a
local root keeps them there, so it needs every remaining shard; a root that is
staged (an object store) is not what can run out, and its staging folder holds
only the shard in flight (written, checked, published, then deleted), so it needs
the largest remaining shard, not the version. Superseded versions are listed and
deleted the same way wherever the root is.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_dagster import storage
from eagle3_dagster.hidden.sharding import ShardSpec
from eagle3_dagster.hidden.shards import (
    ShardFormat,
    load_manifest,
    manifest_bytes,
    manifest_entry,
    manifest_path,
    shard_file_size,
    shard_path,
)

VERSION_PATTERN = re.compile(r"^hs-[0-9a-f]{12}$")
TIB = 1024**4


@dataclass(frozen=True)
class VersionInfo:
    version: str
    path: storage.Location
    num_bytes: int

    @property
    def summary(self) -> dict:
        return {"version": self.version, "path": str(self.path), "bytes": self.num_bytes}


@dataclass(frozen=True)
class ExtractionEstimate:
    """What extracting a plan's version costs and whether it fits: `estimate_extraction`'s answer."""

    version: str
    version_dir: storage.Location
    num_shards: int
    num_samples: int
    num_tokens: int
    shard_bytes: int  # all shard files of the version
    manifest_bytes: int  # all per-shard manifests
    total_bytes: int  # shard_bytes + manifest_bytes: what the finished version occupies
    remaining_bytes: int  # of total_bytes, what is not yet written (complete shards are excluded)
    remaining_tokens: int
    estimated_hours: float  # remaining_tokens / throughput
    free_bytes: int
    fits: bool
    superseded: list[VersionInfo] = field(default_factory=list)
    message: str = ""
    num_hosts: int = 1  # estimated_hours is for this many hosts
    hours_by_hosts: dict[int, float] = field(
        default_factory=dict
    )  # the remaining shards on 1, 2, 4 and num_hosts hosts
    needed_bytes: int = 0  # what must fit in free_bytes: remaining_bytes, or for a store the largest shard in flight
    free_at: str = ""  # where free_bytes was measured: hidden.root, or the staging folder for a store

    @property
    def superseded_bytes(self) -> int:
        return sum(v.num_bytes for v in self.superseded)


def shard_bytes(spec: ShardSpec, fmt: ShardFormat) -> int:
    return shard_file_size(fmt, spec.key, spec.sample_ids, spec.lengths)


def shard_manifest_bytes(spec: ShardSpec, fmt: ShardFormat) -> int:
    """The manifest's exact size: its only unknown, the sha256, is fixed-width hex."""
    entry = manifest_entry(
        fmt,
        spec.key,
        spec.sample_ids,
        spec.lengths,
        first_record=spec.first_record,
        sha256="0" * 64,
        num_bytes=shard_bytes(spec, fmt),
    )
    return len(manifest_bytes(entry))


def free_bytes_at(path: Path) -> int:
    """Free space on the file system that holds `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def complete_keys(version_dir: storage.Location, shards: Sequence[ShardSpec]) -> set[str]:
    """Keys whose manifest names the planned samples and whose file has the recorded size
    (`shards.is_shard_complete` for every shard, from one listing and one manifest read)."""
    sizes = storage.location(version_dir).file_sizes()
    manifest = load_manifest(version_dir) if sizes else {}
    done = set()
    for spec in shards:
        entry = manifest.get(spec.key)
        if (
            entry is not None
            and sizes.get(shard_path(version_dir, spec.key).name) == entry["bytes"]
            and [s["id"] for s in entry["samples"]] == list(spec.sample_ids)
        ):
            done.add(spec.key)
    return done


def find_versions(root: storage.Location, current: str) -> list[VersionInfo]:
    """Every hidden-state version folder under root other than `current` (real folders named like a version)."""
    root = storage.location(root)
    return [
        VersionInfo(version=n, path=root.join(n), num_bytes=root.join(n).tree_bytes())
        for n in root.subfolders()
        if n != current and VERSION_PATTERN.match(n)
    ]


def hours_on_hosts(shard_tokens: Sequence[int], throughput_tokens_per_s: float, num_hosts: int) -> float:
    """Wall hours for these shards on `num_hosts` hosts, each extracting `throughput_tokens_per_s`.

    A shard is what one run extracts on one host, so this is the one-host time divided by the number of
    hosts rounded up to whole shards: shards go, in key order, to the first host that is free (as the
    automation's runs lease hosts), and the time is that of the host that finishes last. Equal shards:
    ceil(S / N) shard-times.
    """
    if num_hosts < 1:
        raise ValueError(f"num_hosts must be >= 1, got {num_hosts}")
    finish = [0] * num_hosts  # tokens each host has extracted when its current shard ends
    for tokens in shard_tokens:
        finish[finish.index(min(finish))] += tokens
    return max(finish) / throughput_tokens_per_s / 3600.0


def estimate_extraction(
    shards: Sequence[ShardSpec],
    fmt: ShardFormat,
    root: storage.Location | Path | str,
    version: str,
    *,
    throughput_tokens_per_s: float,
    free_bytes: int | None = None,
    num_hosts: int = 1,
    staging_dir: Path | None = None,
) -> ExtractionEstimate:
    """Bytes and time for the whole version and for what is still missing, and whether it fits.

    `free_bytes` (or a measurement) is that of the folder shards are written in (`root.local_folder`). Where
    they stay there (a local root) all remaining shards must fit; where they are published elsewhere (an
    object store) what must fit is the largest remaining shard with its manifest."""
    root = storage.location(root)
    free_at = root.local_folder(staging_dir)
    published = storage.location(free_at) != root  # shards leave the folder they are written in
    version_dir = root.join(version)
    done = complete_keys(version_dir, shards)
    total_shard = total_manifest = remaining = remaining_tokens = largest = 0
    remaining_shard_tokens: list[int] = []  # per remaining shard, in key order
    for spec in shards:
        s, m = shard_bytes(spec, fmt), shard_manifest_bytes(spec, fmt)
        total_shard += s
        total_manifest += m
        if spec.key not in done:
            remaining += s + m
            remaining_tokens += spec.num_tokens
            remaining_shard_tokens.append(spec.num_tokens)
            largest = max(largest, s + m)
    free = free_bytes_at(free_at) if free_bytes is None else int(free_bytes)
    needed = largest if published else remaining
    superseded = find_versions(root, version)
    fits = needed <= free
    reclaim = sum(v.num_bytes for v in superseded)
    where = f"the staging folder {free_at} (one shard in flight; the shards go to {root})" if published else str(root)
    if fits:
        message = f"needs {human_bytes(needed)} of {human_bytes(free)} free at {where}"
    else:
        short = needed - free
        message = (
            f"does not fit: needs {human_bytes(needed)}, {human_bytes(free)} free at {where}, "
            f"short by {human_bytes(short)}"
        )
        if superseded and not published:  # versions elsewhere free nothing in the staging folder
            names = ", ".join(f"{v.version} ({human_bytes(v.num_bytes)})" for v in superseded)
            enough = "enough" if reclaim >= short else "not enough"
            message += f"; deleting superseded versions would free {human_bytes(reclaim)} ({enough}): {names}"
    hours = {
        n: hours_on_hosts(remaining_shard_tokens, throughput_tokens_per_s, n) for n in sorted({1, 2, 4, num_hosts})
    }
    return ExtractionEstimate(
        version=version,
        version_dir=version_dir,
        num_shards=len(shards),
        num_samples=sum(s.num_records for s in shards),
        num_tokens=sum(s.num_tokens for s in shards),
        shard_bytes=total_shard,
        manifest_bytes=total_manifest,
        total_bytes=total_shard + total_manifest,
        remaining_bytes=remaining,
        remaining_tokens=remaining_tokens,
        estimated_hours=hours[num_hosts],
        free_bytes=free,
        fits=fits,
        superseded=superseded,
        message=message,
        num_hosts=num_hosts,
        hours_by_hosts=hours,
        needed_bytes=needed,
        free_at=str(free_at),
    )


def actual_bytes(version_dir: storage.Location, shard_keys: Sequence[str]) -> int:
    """Bytes on disk (or on the store) of these shards and their manifests, to compare with the estimate's prediction."""
    sizes = storage.location(version_dir).file_sizes()
    return sum(
        sizes.get(p.name, 0)
        for key in shard_keys
        for p in (shard_path(version_dir, key), manifest_path(version_dir, key))
    )


@dataclass(frozen=True)
class CleanupResult:
    dry_run: bool
    removed: list[VersionInfo]
    freed_bytes: int


def cleanup_superseded(
    root: storage.Location | Path | str,
    current_version: str,
    *,
    dry_run: bool = True,
    log: Callable[[str], None] = print,
) -> CleanupResult:
    """Delete (or, by default, only list) version folders under root that are not the current one.

    Symlinked entries are skipped, not followed; `rmtree` unlinks links inside a
    folder without descending into them; every path is checked to lie inside root.
    On an object store (no links there) a version is every object under its prefix.
    """
    root = storage.location(root)
    removed: list[VersionInfo] = []
    for v in find_versions(root, current_version):
        if v.version == current_version or v.path.parent != root:
            log(f"skip {v.path}: not a version folder directly under {root}")
            continue
        log(f"{'would delete' if dry_run else 'deleting'} {v.path} ({v.num_bytes} bytes)")
        if not dry_run:
            v.path.remove(recursive=True)  # locally shutil.rmtree: unlinks links, never follows them
        removed.append(v)
    freed = sum(v.num_bytes for v in removed)
    log(f"{'would free' if dry_run else 'freed'} {freed} bytes in {len(removed)} superseded versions under {root}")
    return CleanupResult(dry_run=dry_run, removed=removed, freed_bytes=freed)


def human_bytes(n: float | None) -> str:
    """A byte count as people read it (binary units: 4.6 TiB); "unknown" for None."""
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"
