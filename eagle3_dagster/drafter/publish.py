"""Publishing a checked drafter export to its configured location (a local folder or an fsspec URL), and
fetching one back.

Training always writes its export in the run folder, where `check_export` checks it key by key; only then
is it published to `train.export_location`. Each file is uploaded and read back from the store to check
its sha256, and `export_manifest.json` (file → bytes, sha256) is written last, so a publish that dies
midway leaves no manifest and `fetch_export` refuses it. Fetching re-checks every file against the
manifest and the export against SGLang's layout before anything serves it.

The manifest of a published export is read as foreign: whoever can write the store can write it. Every
name in it must be a bare file name (`io.confined_path`), checked before any file is fetched, so a manifest
naming `../../x` or `/x` writes nothing outside the destination. Publishing reads names only from the local
export folder training wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import re

from eagle3_dagster import storage
from eagle3_dagster.io import ForeignInputError, atomic_open, confined_path, sha256_file

EXPORT_MANIFEST = "export_manifest.json"
EXPORT_FORMAT = "eagle3-drafter-export"


class FileEntry(TypedDict):
    """A file's entry in the manifest's `files`."""

    bytes: int
    sha256: str


def publish_export(
    export_dir: Path, dest: storage.Location | Path | str, *, log: Callable[[str], None] = print
) -> dict:
    """Upload the files of `export_dir` to `dest`, manifest last; an identical publish already there is kept."""
    export_dir, dest = Path(export_dir), storage.location(dest)
    files = sorted(p for p in export_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise FileNotFoundError(f"{export_dir}: no export files to publish")
    entries: dict[str, FileEntry] = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files}
    manifest = {"format": EXPORT_FORMAT, "files": entries}
    manifest_loc = dest.join(EXPORT_MANIFEST)
    try:
        if storage.read_json(manifest_loc) == manifest and all(
            dest.join(name).size() == e["bytes"] for name, e in entries.items()
        ):
            log(f"drafter export already published at {dest}")
            return manifest
    except FileNotFoundError:
        pass
    manifest_loc.remove()  # an old manifest must not vouch for files being replaced
    for p in files:
        log(f"publishing {p.name} ({entries[p.name]['bytes']} bytes) to {dest}")
        dest.join(p.name).upload_file(p, entries[p.name]["sha256"])
    manifest_loc.write_json(manifest)
    return manifest


def fetch_export(src: storage.Location | Path | str, local_dir: Path) -> Path:
    """Copy a published export to `local_dir`, every file checked against the manifest, then `check_export`."""
    from eagle3_dagster.drafter.export import check_export

    src = storage.location(src)
    try:
        manifest = storage.read_json(src.join(EXPORT_MANIFEST))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{src}: no {EXPORT_MANIFEST}; not a published drafter export (or its publish did not finish)"
        ) from None
    where = src.join(EXPORT_MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != EXPORT_FORMAT:
        raise ValueError(
            f"{where}: format {manifest.get('format') if isinstance(manifest, dict) else manifest!r}, "
            f"expected {EXPORT_FORMAT!r}"
        )
    local_dir = Path(local_dir)
    files = _manifest_files(manifest, where, local_dir)  # every entry checked before any file is written
    for name, entry in files.items():
        if (size := src.join(name).size()) != entry["bytes"]:  # also never a device or a FIFO read without end
            got = "missing or not a file" if size is None else f"{size} bytes"
            raise ValueError(
                f"{src.join(name)}: {got}, the manifest says {entry['bytes']} bytes; the published export is corrupted"
            )
        with atomic_open(local_dir / name) as f:  # renamed into place only if it matches the manifest
            size, digest = src.join(name).download_to(f)
            if size != entry["bytes"] or digest != entry["sha256"]:
                raise ValueError(
                    f"{src.join(name)}: {size} bytes, sha256 {digest}; the manifest says "
                    f"{entry['bytes']} bytes, {entry['sha256']}; the published export is corrupted"
                )
    check_export(local_dir).raise_for_errors()
    return local_dir


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _manifest_files(manifest: dict, where: storage.Location, local_dir: Path) -> dict[str, dict]:
    """The manifest's `files`, each name a bare file name (not the manifest's own) and each entry its bytes and
    sha256; a `ForeignInputError` naming the manifest and the entry otherwise."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ForeignInputError(f"{where}: files is not an object of file name → bytes, sha256")
    for name, entry in sorted(files.items()):
        what = f"{where}: files entry {name!r}"
        confined_path(local_dir, name, where=what, flat=True)
        if name == EXPORT_MANIFEST or name.startswith("."):
            raise ForeignInputError(f"{what}: not a file a publish writes; refused")
        if (
            not isinstance(entry, dict)
            or not (
                isinstance(entry.get("bytes"), int) and not isinstance(entry["bytes"], bool) and entry["bytes"] >= 0
            )
            or not _SHA256.fullmatch(str(entry.get("sha256")))
        ):
            raise ForeignInputError(f"{what}: {entry!r} is not {{bytes: a size, sha256: 64 hex digits}}")
    return dict(sorted(files.items()))
