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

A store that stops answering is an error naming the object within a bound the profile sets (`storage`:
botocore's connect and read timeouts and its tries; `wait_bound_s`), and a call that waits logs a line naming
the object every `storage.progress_every_s`. The settings reach the processes this one starts through
`$EAGLE3_STORAGE` (`child_env`); S3 only: other protocols keep their library's defaults.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import orjson

from eagle3_dagster.config import StorageConfig, is_remote, location  # noqa: F401  (locations are read from profiles)
from eagle3_dagster.io import atomic_write_bytes, parse_json, sha256_file

log = logging.getLogger(__name__)

Location = Path | str  # a local path, or an fsspec URL kept as a string
HASH_BLOCK = 8 << 20  # bytes per read when hashing an object on a store
STORAGE_ENV = "EAGLE3_STORAGE"  # the settings in effect, as JSON, for the processes this one starts
_settings: StorageConfig | None = None


class StoreError(OSError):
    """A call to an object store that failed after its tries; names the object, the call and the cause."""


class StoreReadError(StoreError):
    """Byte ranges of an object that could not be read after retries; names the object and the cause."""


def configure(settings: StorageConfig | None) -> None:
    """The profile's `storage` settings for every store call of this process from now on (None: those
    $EAGLE3_STORAGE holds, else the defaults)."""
    global _settings
    _settings = settings


def settings() -> StorageConfig:
    return _settings if _settings is not None else _from_env(os.environ.get(STORAGE_ENV))


@functools.lru_cache(maxsize=4)
def _from_env(text: str | None) -> StorageConfig:
    return StorageConfig.model_validate_json(text) if text else StorageConfig()


def child_env() -> dict[str, str]:
    """Environment that gives a process started from this one (torchrun workers, a driver on a GPU host)
    the same storage settings."""
    return {STORAGE_ENV: settings().model_dump_json()}


def wait_bound_s(s: StorageConfig | None = None) -> float:
    """The longest one store request waits before it fails: every try waiting out both timeouts, plus
    botocore's standard-mode backoff before each retry (at most min(2**i, 20) s, and 5 s more for a
    throttling answer carrying x-amz-retry-after)."""
    s = s or settings()
    backoff = sum(min(2**i, 20) + 5 for i in range(s.attempts - 1))
    return s.attempts * (s.connect_timeout_s + s.read_timeout_s) + backoff


def _tries(s: StorageConfig) -> str:
    return (f"tried up to {s.attempts} times (storage.attempts), each waiting up to {s.connect_timeout_s:g} s "
            f"to connect and {s.read_timeout_s:g} s per read (storage.connect_timeout_s, storage.read_timeout_s)")


class _Waits:
    """The store calls in flight, and one daemon thread that logs a line for each call waiting longer than
    `progress_every_s`, naming the object, then again each time that passes. botocore waits on its sockets
    without a callback, so a thread beside the call is the only way to say anything while it waits."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked child (a DataLoader worker) starts afresh

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[int, list] = {}  # key -> [what, started, next line at, every, bound]
        self._keys = iter(range(1 << 62))
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        s = settings()
        now = time.monotonic()
        with self._lock:
            key = next(self._keys)
            self._calls[key] = [what, now, now + s.progress_every_s, s.progress_every_s, wait_bound_s(s)]
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="store-waits", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._calls.pop(key, None)

    def _watch(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                due = []
                for call in self._calls.values():
                    if now >= call[2]:
                        due.append((call[0], now - call[1], call[4]))
                        call[2] = now + call[3]
                wake = min((call[2] for call in self._calls.values()), default=now + 1.0)
            for what, waited, bound in due:
                log.warning("%s: still in progress after %.1f s (a store request that gets no answer fails "
                            "within %.0f s: storage.attempts x (connect_timeout_s + read_timeout_s) plus backoff)",
                            what, waited, bound)
            time.sleep(min(max(wake - time.monotonic(), 0.01), 1.0))


_WAITS = _Waits()


def _on_store(loc: Location, action: str, call: Callable):
    """`call(fs, path)` on the store holding URL `loc`, with progress lines while it waits; a failure other
    than a missing object is a `StoreError` naming `loc`, the action, the tries and the cause."""
    fs, path = filesystem(loc)
    with _WAITS.waiting(f"{loc}: {action}"):
        try:
            return call(fs, path)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise StoreError(f"{loc}: {action} failed ({_tries(settings())}): {type(e).__name__}: {e}") from e


def join(loc: Location, *parts: str) -> Location:
    if is_remote(loc):
        return "/".join([str(loc).rstrip("/"), *parts])
    return Path(loc).joinpath(*parts)


def name(loc: Location) -> str:
    return str(loc).rstrip("/").rsplit("/", 1)[-1]


def parent(loc: Location) -> Location:
    return str(loc).rstrip("/").rsplit("/", 1)[0] if is_remote(loc) else Path(loc).parent


def filesystem(loc: Location):
    """(fsspec filesystem, path inside it) for a URL; an S3 one waits and retries as `storage` settings say."""
    import fsspec

    if str(loc).partition("://")[0] not in ("s3", "s3a"):
        return fsspec.core.url_to_fs(str(loc))
    s = settings()
    fs, path = fsspec.core.url_to_fs(str(loc), config_kwargs={
        "connect_timeout": s.connect_timeout_s, "read_timeout": s.read_timeout_s,
        "retries": {"total_max_attempts": s.attempts, "mode": "standard"}})
    fs.retries = 1  # botocore's tries are the only ones: s3fs's loops (5, nested in reads) would multiply them
    return fs, path


def exists(loc: Location) -> bool:
    """A file, object or folder (a prefix with objects under it, on a store)."""
    if not is_remote(loc):
        return Path(loc).exists()

    def call(fs, path):
        fs.invalidate_cache(path)  # another process may have written it since this one listed
        return fs.exists(path)

    return _on_store(loc, "checking that it exists", call)


def size(loc: Location) -> int | None:
    """Bytes of the file or object, None when it does not exist."""
    if not is_remote(loc):
        try:
            return Path(loc).stat().st_size
        except FileNotFoundError:
            return None
    try:  # refresh: another process may have written it since this one listed
        info = _on_store(loc, "reading its size", lambda fs, path: fs.info(path, refresh=True))
    except FileNotFoundError:
        return None
    return None if info["type"] != "file" else int(info["size"])


def _listing(folder: Location) -> list[dict]:
    try:
        return _on_store(folder, "listing it", lambda fs, path: fs.ls(path, detail=True, refresh=True))
    except FileNotFoundError:
        return []


def file_sizes(folder: Location) -> dict[str, int]:
    """name -> bytes of the files directly in `folder` (empty when it does not exist); one listing call."""
    if not is_remote(folder):
        p = Path(folder)
        return {c.name: c.stat().st_size for c in p.iterdir() if c.is_file()} if p.is_dir() else {}
    return {name(e["name"]): int(e["size"]) for e in _listing(folder) if e["type"] == "file"}


def subfolders(folder: Location) -> list[str]:
    """Names of the folders directly in `folder` (local: real folders, never symlinks)."""
    if not is_remote(folder):
        p = Path(folder)
        return sorted(c.name for c in p.iterdir() if c.is_dir() and not c.is_symlink()) if p.is_dir() else []
    return sorted(name(e["name"]) for e in _listing(folder) if e["type"] == "directory")


def tree_bytes(folder: Location) -> int:
    """Bytes of everything under a folder on a store (local folders: `hidden.plan.tree_bytes`)."""
    return int(_on_store(folder, "adding up its size", lambda fs, path: fs.du(path, total=True)))


def read_bytes(loc: Location) -> bytes:
    if not is_remote(loc):
        return Path(loc).read_bytes()
    return _on_store(loc, "reading it", lambda fs, path: fs.cat_file(path))


def read_many(locs: Sequence[Location]) -> list[bytes]:
    """Several whole files; on a store, fetched concurrently in one call (fsspec `cat`)."""
    remote = [loc for loc in locs if is_remote(loc)]
    if not remote:
        return [Path(loc).read_bytes() for loc in locs]
    paths = [filesystem(loc)[1] for loc in locs]
    got = _on_store(remote[0], f"reading it and {len(locs) - 1} more objects",
                    lambda fs, _: fs.cat(paths, on_error="raise"))
    return [got[p] for p in paths]


def write_bytes(loc: Location, data: bytes) -> None:
    """Whole-object write: temp + rename locally, one PUT (atomic) on a store."""
    if not is_remote(loc):
        atomic_write_bytes(loc, data)
        return
    _on_store(loc, f"writing {len(data)} bytes", lambda fs, path: fs.pipe_file(path, data))


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
    try:
        _on_store(loc, "deleting it", lambda fs, path: fs.rm(path, recursive=recursive))
    except FileNotFoundError:
        pass


def sha256(loc: Location) -> str:
    """sha256 of the bytes as stored: a store's object is read back in full, never taken from metadata."""
    if not is_remote(loc):
        return sha256_file(loc)
    with open(os.devnull, "wb") as sink:
        return download_to(loc, sink)[1]


def read_ranges(loc: Location, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """Byte ranges [start, end) of one file or object; on a store, concurrent range GETs in one call.

    Each GET is tried as `storage` settings say (botocore); a range that still failed is a `StoreReadError`
    naming the object, the bytes and the cause (fsspec hands it back as an exception object in the list)."""
    if not is_remote(loc):
        out = []
        with open(loc, "rb") as f:
            for start, end in ranges:
                f.seek(start)
                out.append(f.read(end - start))
        return out
    got = _on_store(loc, f"reading {len(ranges)} byte range(s)", lambda fs, path: fs.cat_ranges(
        [path] * len(ranges), [r[0] for r in ranges], [r[1] for r in ranges], on_error="return"))
    failed = [(r, blob) for r, blob in zip(ranges, got, strict=True) if isinstance(blob, BaseException)]
    if failed:
        (start, end), err = failed[0]
        raise StoreReadError(f"{loc}: bytes [{start}, {end}) could not be read ({len(failed)} of {len(ranges)} "
                             f"ranges failed; {_tries(settings())}): {type(err).__name__}: {err}") from err
    return got


def download_to(loc: Location, out) -> tuple[int, str]:
    """Stream a file or object into the open binary file `out`; returns (bytes, sha256) of what was written."""
    h, n = hashlib.sha256(), 0

    def copy(src) -> None:
        nonlocal n
        with src:
            while block := src.read(HASH_BLOCK):
                out.write(block)
                h.update(block)
                n += len(block)

    if is_remote(loc):
        _on_store(loc, "reading it whole", lambda fs, path: copy(fs.open(path, "rb", block_size=HASH_BLOCK,
                                                                           cache_type="none")))
    else:
        copy(open(loc, "rb"))
    return n, h.hexdigest()


class UploadMismatch(RuntimeError):
    """The bytes read back from the store are not the bytes that were uploaded."""


def upload_file(local: Path, loc: Location, expected_sha256: str) -> None:
    """Copy a local file to `loc`, then read it back from the store and check its sha256.

    Nothing may vouch for the object until this returns: callers write the manifest afterwards."""
    if is_remote(loc):
        _on_store(loc, f"uploading {local}", lambda fs, path: fs.put_file(str(local), path))
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
