"""Where artifacts may live: a local path (the default) or an fsspec URL (`s3://…`, `gs://…`).

Owns the few operations the hidden-state store and the drafter export need on either kind of location,
through fsspec: join, exists, size, list, read, write whole objects, hash, range reads, upload with a
checksum re-read, delete. A local location stays a `Path` and keeps the local primitives of `io.py`
(temp name + rename), so local runs behave exactly as before; a URL stays a `str`, since `Path` would
fold `s3://` into `s3:/`.

Object stores have no rename; what makes a write safe there is that one PUT is atomic (an object is
either all there or absent: s3fs sends a single PUT or a multipart upload that appears only when it
completes), and that a shard counts as complete only through its manifest, written after the shard's
bytes were read back from the store and hashed.

Credentials and endpoints come from the environment only (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_ENDPOINT_URL`, …, read by s3fs/botocore themselves; `GOOGLE_APPLICATION_CREDENTIALS` for gcsfs);
nothing here reads, logs or stores them, and locations never carry them (`s3://key:secret@…` is refused).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

import orjson

from eagle3_dagster.io import atomic_write_bytes, sha256_file

Location = Path | str  # a local path, or an fsspec URL kept as a string
HASH_BLOCK = 8 << 20  # bytes per read when hashing an object on a store
READ_ATTEMPTS = 4  # range reads of a store: tries of a failed range (s3fs/botocore retry inside each)
READ_BACKOFF_S = 0.5  # doubled after each failed try


class StoreReadError(OSError):
    """Byte ranges of an object that could not be read after retries; names the object and the cause."""


def is_remote(loc: str | os.PathLike) -> bool:
    """True for a URL with a protocol other than the local file system."""
    if isinstance(loc, os.PathLike):
        return False
    scheme, sep, _ = str(loc).partition("://")
    return bool(sep) and scheme not in ("", "file", "local")


def location(loc: str | os.PathLike, base: Path | None = None) -> Location:
    """A profile value as a location: a URL unchanged (no trailing slash), a relative path under `base`."""
    if is_remote(loc):
        url = str(loc).rstrip("/")
        if "@" in url.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(f"{_redact(url)}: credentials do not belong in a storage URL; set them in the "
                             "environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, …)")
        return url
    text = str(loc)
    p = Path(text[len("file://"):] if text.startswith("file://") else text)
    return p if p.is_absolute() or base is None else base / p


def _redact(url: str) -> str:
    scheme, _, rest = url.partition("://")
    host, _, path = rest.partition("/")
    return f"{scheme}://{host.rpartition('@')[2]}/{path}"


def join(loc: Location, *parts: str) -> Location:
    if is_remote(loc):
        return "/".join([str(loc).rstrip("/"), *parts])
    return Path(loc).joinpath(*parts)


def name(loc: Location) -> str:
    return str(loc).rstrip("/").rsplit("/", 1)[-1]


def parent(loc: Location) -> Location:
    return str(loc).rstrip("/").rsplit("/", 1)[0] if is_remote(loc) else Path(loc).parent


def filesystem(loc: Location):
    """(fsspec filesystem, path inside it) for a URL."""
    import fsspec

    return fsspec.core.url_to_fs(str(loc))


def exists(loc: Location) -> bool:
    """A file, object or folder (a prefix with objects under it, on a store)."""
    if not is_remote(loc):
        return Path(loc).exists()
    fs, path = filesystem(loc)
    fs.invalidate_cache(path)  # another process may have written it since this one listed
    return fs.exists(path)


def size(loc: Location) -> int | None:
    """Bytes of the file or object, None when it does not exist."""
    if not is_remote(loc):
        try:
            return Path(loc).stat().st_size
        except FileNotFoundError:
            return None
    fs, path = filesystem(loc)
    try:
        info = fs.info(path, refresh=True)  # another process may have written it since this one listed
    except FileNotFoundError:
        return None
    return None if info["type"] != "file" else int(info["size"])


def file_sizes(folder: Location) -> dict[str, int]:
    """name -> bytes of the files directly in `folder` (empty when it does not exist); one listing call."""
    if not is_remote(folder):
        p = Path(folder)
        return {c.name: c.stat().st_size for c in p.iterdir() if c.is_file()} if p.is_dir() else {}
    fs, path = filesystem(folder)
    try:
        entries = fs.ls(path, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    return {name(e["name"]): int(e["size"]) for e in entries if e["type"] == "file"}


def subfolders(folder: Location) -> list[str]:
    """Names of the folders directly in `folder` (local: real folders, never symlinks)."""
    if not is_remote(folder):
        p = Path(folder)
        return sorted(c.name for c in p.iterdir() if c.is_dir() and not c.is_symlink()) if p.is_dir() else []
    fs, path = filesystem(folder)
    try:
        entries = fs.ls(path, detail=True, refresh=True)
    except FileNotFoundError:
        return []
    return sorted(name(e["name"]) for e in entries if e["type"] == "directory")


def tree_bytes(folder: Location) -> int:
    """Bytes of everything under a folder on a store (local folders: `hidden.plan.tree_bytes`)."""
    fs, path = filesystem(folder)
    return int(fs.du(path, total=True))


def read_bytes(loc: Location) -> bytes:
    if not is_remote(loc):
        return Path(loc).read_bytes()
    fs, path = filesystem(loc)
    return fs.cat_file(path)


def read_many(locs: Sequence[Location]) -> list[bytes]:
    """Several whole files; on a store, fetched concurrently in one call (fsspec `cat`)."""
    remote = [loc for loc in locs if is_remote(loc)]
    if not remote:
        return [Path(loc).read_bytes() for loc in locs]
    fs, _ = filesystem(remote[0])
    paths = [filesystem(loc)[1] for loc in locs]
    got = fs.cat(paths, on_error="raise")
    return [got[p] for p in paths]


def write_bytes(loc: Location, data: bytes) -> None:
    """Whole-object write: temp + rename locally, one PUT (atomic) on a store."""
    if not is_remote(loc):
        atomic_write_bytes(loc, data)
        return
    fs, path = filesystem(loc)
    fs.pipe_file(path, data)


def parse_json(blob: bytes, loc: Location):
    """The JSON in `blob`, read from `loc`; an error that names `loc` when it is not JSON (cut off, garbled)."""
    try:
        return orjson.loads(blob)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{loc}: not valid JSON ({len(blob)} bytes; {e})") from None


def read_json(loc: Location):
    return parse_json(read_bytes(loc), loc)


def write_json(loc: Location, obj) -> None:
    """Same bytes as `io.atomic_write_json`, so predicted manifest sizes hold on a store too."""
    write_bytes(loc, orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))


def remove(loc: Location, *, recursive: bool = False) -> None:
    """Delete a file or object (a folder with `recursive`); absent is fine."""
    if not is_remote(loc):
        import shutil

        p = Path(loc)
        if recursive and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
        return
    fs, path = filesystem(loc)
    try:
        fs.rm(path, recursive=recursive)
    except FileNotFoundError:
        pass


def sha256(loc: Location) -> str:
    """sha256 of the bytes as stored: a store's object is read back in full, never taken from metadata."""
    if not is_remote(loc):
        return sha256_file(loc)
    with open(os.devnull, "wb") as sink:
        return download_to(loc, sink)[1]


def read_ranges(loc: Location, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """Byte ranges [start, end) of one file or object; on a store, concurrent range GETs in one call."""
    if not is_remote(loc):
        out = []
        with open(loc, "rb") as f:
            for start, end in ranges:
                f.seek(start)
                out.append(f.read(end - start))
        return out
    fs, path = filesystem(loc)
    out: list[bytes | None] = [None] * len(ranges)
    todo = list(range(len(ranges)))
    for attempt in range(READ_ATTEMPTS):
        # fsspec hands back a failed range as its exception object in the list, not raised
        got = fs.cat_ranges([path] * len(todo), [ranges[i][0] for i in todo], [ranges[i][1] for i in todo],
                            on_error="return")
        failed = [(i, blob) for i, blob in zip(todo, got, strict=True) if isinstance(blob, BaseException)]
        for i, blob in zip(todo, got, strict=True):
            if not isinstance(blob, BaseException):
                out[i] = blob
        if not failed:
            return out  # type: ignore[return-value]
        todo = [i for i, _ in failed]
        if attempt + 1 < READ_ATTEMPTS:
            time.sleep(READ_BACKOFF_S * 2**attempt)
    i, err = failed[0]
    raise StoreReadError(f"{loc}: bytes [{ranges[i][0]}, {ranges[i][1]}) could not be read after {READ_ATTEMPTS} "
                         f"tries ({len(failed)} of {len(ranges)} ranges failed): {type(err).__name__}: {err}")


def download_to(loc: Location, out) -> tuple[int, str]:
    """Stream a file or object into the open binary file `out`; returns (bytes, sha256) of what was written."""
    h, n = hashlib.sha256(), 0
    if is_remote(loc):
        fs, path = filesystem(loc)
        src = fs.open(path, "rb", block_size=HASH_BLOCK, cache_type="none")
    else:
        src = open(loc, "rb")
    with src:
        while block := src.read(HASH_BLOCK):
            out.write(block)
            h.update(block)
            n += len(block)
    return n, h.hexdigest()


class UploadMismatch(RuntimeError):
    """The bytes read back from the store are not the bytes that were uploaded."""


def upload_file(local: Path, loc: Location, expected_sha256: str) -> None:
    """Copy a local file to `loc`, then read it back from the store and check its sha256.

    Nothing may vouch for the object until this returns: callers write the manifest afterwards."""
    if is_remote(loc):
        fs, path = filesystem(loc)
        fs.put_file(str(local), path)
    else:
        import shutil

        Path(loc).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(loc).with_name(f".{Path(loc).name}.{os.getpid()}.upload")
        shutil.copyfile(local, tmp)
        os.replace(tmp, loc)
    digest = sha256(loc)
    if digest != expected_sha256:
        raise UploadMismatch(f"{loc}: sha256 read back from the store is {digest}, the uploaded file's is "
                             f"{expected_sha256}; the object is not trusted (no manifest written)")
