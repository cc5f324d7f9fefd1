"""Where artifacts live: `Location`, one type for a local path (the default) and an fsspec URL (`s3://…`, `gs://…`).

Owns what a location is (parsing a profile value, refusing credentials in a URL), every operation the
hidden-state store and the drafter export need on one (join, exists, size, list, read, write whole objects,
hash, range reads, upload with a checksum re-read, delete), the staging model (`local_folder`: files bound for a
store are written in a local staging folder, then published; a local folder is its own staging folder and
publishing to it is a no-op), and how long a store call may wait (`StorageSettings`). It is the only module that asks
whether a location is on this machine; `hidden/ranged.py` (memory map or range reads) is the other half of
the storage layer. Callers hold a `Location` and never branch on its kind.

Both kinds go through fsspec (`LocalFileSystem` for a path), and our own code is kept only where fsspec
lacks something, each said where it is: an atomic local write (fsspec writes a local file in place, so a
reader could see it half-written; we write a temp name and rename), a local folder's size that never
follows links (fsspec's local `du` counts a link as the size of what it points to), and a local file
memory-mapped by safetensors (`ranged.open_tensors`).

Object stores have no rename; what makes a write safe there is that one PUT is atomic (an object is
either all there or absent: s3fs sends a single PUT or a multipart upload that appears only when it
completes), and that a shard counts as complete only through its manifest, written after the shard's
bytes were read back from the store and hashed.

Credentials and endpoints come from the environment only (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_ENDPOINT_URL`, …, read by s3fs/botocore themselves; `GOOGLE_APPLICATION_CREDENTIALS` for gcsfs);
nothing here reads, logs or stores them, and locations never carry them (`s3://key:secret@…`, also with a '/' in the secret, and a signature in the query are
refused: url_secrets).

A store that stops answering is an error naming the object within a bound the profile sets (`storage`:
botocore's connect and read timeouts and its tries; `wait_bound_s`), and a call that waits logs a line naming
the object every `progress_every_s`. The settings reach the processes this one starts through
`$EAGLE3_STORAGE` (`child_env`); S3 only: other protocols keep their library's defaults. They are a frozen
dataclass here, not the profile's pydantic model: `config` validates locations with this module, and the
profile's `storage` section takes its defaults from `StorageSettings`, so the import goes one way only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import posixpath
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import fsspec
import orjson

from eagle3_dagster.io import atomic_write_bytes, json_bytes, parse_json
from eagle3_dagster.url_secrets import url_credentials

log = logging.getLogger(__name__)

HASH_BLOCK = 8 << 20  # bytes per read when hashing a file or object
STORAGE_ENV = "EAGLE3_STORAGE"  # the settings in effect, as JSON, for the processes this one starts
_LOCAL_SCHEMES = ("", "file", "local")


@dataclass(frozen=True)
class StorageSettings:
    """How long an object-store call may wait (the profile's `storage` section, `config.StorageConfig`,
    documents and bounds each field and takes these defaults)."""

    connect_timeout_s: float = 10.0
    read_timeout_s: float = 30.0
    attempts: int = 4
    progress_every_s: float = 30.0

    @classmethod
    def of(cls, settings) -> "StorageSettings":
        """These settings from any object with the same fields (the profile's `StorageConfig`)."""
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})


_settings: StorageSettings | None = None


class StoreError(OSError):
    """A call to an object store that failed after its tries; names the object, the call and the cause."""


class StoreReadError(StoreError):
    """Byte ranges of an object that could not be read after retries; names the object and the cause."""


class UploadMismatch(RuntimeError):
    """The bytes read back from the store are not the bytes that were uploaded."""


def configure(settings) -> None:
    """The profile's `storage` settings for every store call of this process from now on (None: those
    $EAGLE3_STORAGE holds, else the defaults)."""
    global _settings
    _settings = None if settings is None else StorageSettings.of(settings)


def settings() -> StorageSettings:
    return _settings if _settings is not None else _from_env(os.environ.get(STORAGE_ENV))


def _from_env(text: str | None) -> StorageSettings:
    return StorageSettings(**orjson.loads(text)) if text else StorageSettings()


def child_env() -> dict[str, str]:
    """Environment that gives a process started from this one (torchrun workers, a driver on a GPU host)
    the same storage settings."""
    return {STORAGE_ENV: orjson.dumps(dataclasses.asdict(settings())).decode()}


def wait_bound_s(s=None) -> float:
    """The longest one store request waits before it fails: every try waiting out both timeouts, plus
    botocore's standard-mode backoff before each retry (at most min(2**i, 20) s, and 5 s more for a
    throttling answer carrying x-amz-retry-after)."""
    s = s or settings()
    backoff = sum(min(2**i, 20) + 5 for i in range(s.attempts - 1))
    return s.attempts * (s.connect_timeout_s + s.read_timeout_s) + backoff


def _tries(s: StorageSettings) -> str:
    return (
        f"tried up to {s.attempts} times (storage.attempts), each waiting up to {s.connect_timeout_s:g} s "
        f"to connect and {s.read_timeout_s:g} s per read (storage.connect_timeout_s, storage.read_timeout_s)"
    )


class _Waits:
    """The store calls in flight, and one daemon thread that logs a line for each call waiting longer than
    `progress_every_s`, naming the object, then again each time that passes. botocore waits on its sockets
    without a callback, so a thread beside the call is the only way to say anything while it waits."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked child (a DataLoader worker) starts afresh

    def _reset(self) -> None:
        # a Condition, so that a call begun while the watcher idles wakes it (its idle sleep is 1 s, longer
        # than a short progress_every_s)
        self._lock = threading.Condition()
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
            self._lock.notify()
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
                if not due:  # waits holding the lock until then, so no call's notify is missed
                    wake = min((call[2] for call in self._calls.values()), default=now + 1.0)
                    self._lock.wait(timeout=min(max(wake - now, 0.01), 1.0))
                    continue
            for what, waited, bound in due:
                log.warning(
                    "%s: still in progress after %.1f s (a store request that gets no answer fails "
                    "within %.0f s: storage.attempts x (connect_timeout_s + read_timeout_s) plus backoff)",
                    what,
                    waited,
                    bound,
                )


_WAITS = _Waits()


def filesystem(url: str):
    """(fsspec filesystem, path inside it) for a URL or path; an S3 one waits and retries as the `storage`
    settings say."""
    if str(url).partition("://")[0] not in ("s3", "s3a"):
        return fsspec.core.url_to_fs(str(url))
    s = settings()
    fs, path = fsspec.core.url_to_fs(
        str(url),
        config_kwargs={
            "connect_timeout": s.connect_timeout_s,
            "read_timeout": s.read_timeout_s,
            "retries": {"total_max_attempts": s.attempts, "mode": "standard"},
        },
    )
    fs.retries = 1  # botocore's tries are the only ones: s3fs's loops (5, nested in reads) would multiply them
    return fs, path


def _is_local(text: str) -> bool:
    scheme, sep, _ = text.partition("://")
    return not sep or scheme in _LOCAL_SCHEMES


def location(loc: "str | os.PathLike | Location", base: Path | None = None) -> "Location":
    """A profile value (or a path, or a Location) as a Location: a URL unchanged but for a trailing slash,
    a relative path under `base`. A URL carrying credentials is refused without repeating them."""
    if isinstance(loc, Location):
        return loc
    text = os.fspath(loc) if isinstance(loc, os.PathLike) else str(loc)
    if isinstance(loc, os.PathLike) or _is_local(text):
        p = Path(text[len("file://") :] if text.startswith("file://") else text)
        return Location(str(p if p.is_absolute() or base is None else base / p))
    url = text.rstrip("/")
    if why := url_credentials(url):
        scheme = url.partition("://")[0]
        raise ValueError(
            f"a {scheme}:// location carries a credential, {why}; the URL is not shown. Credentials do not "
            "belong in a storage URL: set them in the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, …)"
        )
    return Location(url)


@dataclass(frozen=True)
class Location:
    """A file, object or folder: a path on this machine (`url` is the path) or an fsspec URL.

    Build one with `location()`. `str()` gives it back as the profile wrote it; a local one is also a
    path-like (`Path(loc)`, `open(loc)`), a store's is not."""

    url: str

    def __str__(self) -> str:
        return self.url

    def __fspath__(self) -> str:
        return str(self.local_path())

    @property
    def _local(self) -> bool:
        return _is_local(self.url)

    def local_path(self) -> Path:
        """This location as a path on this machine; a ValueError for one on a store."""
        if not self._local:
            raise ValueError(f"{self}: is on an object store, not a local path")
        return Path(self.url)

    def local_folder(self, staging: Path | None) -> Path:
        """The folder on this machine where files bound here are written: this one when it is a local folder
        (publishing to it is then a no-op), or for a store the staging folder `staging`, from which they are
        published (uploaded)."""
        if self._local:
            return Path(self.url)
        if staging is None:
            raise ValueError(
                f"{self} is on an object store: hidden.staging_dir (a local folder) is needed to "
                "write shards before they are uploaded"
            )
        return Path(staging)

    def join(self, *parts: str) -> "Location":
        return Location(posixpath.join(self.url, *parts) if parts else self.url)

    def __truediv__(self, part: str) -> "Location":
        return self.join(part)

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> "Location":
        return Location(str(Path(self.url).parent)) if self._local else Location(self.url.rsplit("/", 1)[0])

    def _fs(self):
        return filesystem(self.url)

    def _call(self, action: str, call: Callable):
        """`call(fs, path)`; on a store with progress lines while it waits, and a failure other than a missing
        object is a `StoreError` naming the location, the action, the tries and the cause (local errors, a
        full disk included, pass as they are)."""
        fs, path = self._fs()
        if self._local:
            return call(fs, path)
        with _WAITS.waiting(f"{self}: {action}"):
            try:
                return call(fs, path)
            except FileNotFoundError:
                raise
            except Exception as e:
                raise StoreError(f"{self}: {action} failed ({_tries(settings())}): {type(e).__name__}: {e}") from e

    def exists(self) -> bool:
        """A file, object or folder (a prefix with objects under it, on a store)."""

        def call(fs, path):
            fs.invalidate_cache(path)  # another process may have written it since this one listed
            return fs.exists(path)

        return self._call("checking that it exists", call)

    def size(self) -> int | None:
        """Bytes of the file or object, None when it does not exist (or is a folder)."""
        try:  # refresh: another process may have written it since this one listed
            info = self._call("reading its size", lambda fs, path: fs.info(path, refresh=True))
        except FileNotFoundError:
            return None
        return None if info["type"] != "file" else int(info["size"])

    def _listing(self) -> list[dict]:
        try:
            return self._call("listing it", lambda fs, path: fs.ls(path, detail=True, refresh=True))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def file_sizes(self) -> dict[str, int]:
        """name -> bytes of the files directly in this folder (empty when it does not exist); one listing call."""
        return {
            posixpath.basename(e["name"].rstrip("/")): int(e["size"]) for e in self._listing() if e["type"] == "file"
        }

    def subfolders(self) -> list[str]:
        """Names of the folders directly in this folder (locally real folders: fsspec types a link "other")."""
        return sorted(posixpath.basename(e["name"].rstrip("/")) for e in self._listing() if e["type"] == "directory")

    def tree_bytes(self) -> int:
        """Bytes of everything under this folder, never following links (a link counts as itself)."""
        if not self._local:
            return int(self._call("adding up its size", lambda fs, path: fs.du(path, total=True)))
        total = 0  # our own walk: fsspec's local du counts a link as the size of what it points to
        for root, dirs, files in os.walk(self.url, followlinks=False):
            for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
                total += os.lstat(os.path.join(root, name)).st_size
        return total

    def read_bytes(self) -> bytes:
        return self._call("reading it", lambda fs, path: fs.cat_file(path))

    def write_bytes(self, data: bytes) -> None:
        """Whole-object write: one PUT (atomic) on a store; locally a temp name renamed into place, since
        fsspec writes a local file in place."""
        if self._local:
            atomic_write_bytes(self.url, data)
            return
        self._call(f"writing {len(data)} bytes", lambda fs, path: fs.pipe_file(path, data))

    def write_json(self, obj) -> None:
        """Same bytes as `io.atomic_write_json` (`io.json_bytes`), so predicted manifest sizes hold on a store too."""
        self.write_bytes(json_bytes(obj))

    def remove(self, *, recursive: bool = False) -> None:
        """Delete a file or object (a folder with `recursive`; locally a link is unlinked, never followed);
        absent is fine."""
        try:
            self._call("deleting it", lambda fs, path: fs.rm(path, recursive=recursive))
        except FileNotFoundError:
            pass

    def sha256(self) -> str:
        """sha256 of the bytes as stored: a store's object is read back in full, never taken from metadata."""
        with open(os.devnull, "wb") as sink:
            return self.download_to(sink)[1]

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Byte ranges [start, end) of this file or object; on a store, concurrent range GETs in one call.

        Each GET is tried as `storage` settings say (botocore); a range that still failed is a
        `StoreReadError` naming the object, the bytes and the cause (fsspec hands it back as an exception
        object in the list)."""
        got = self._call(
            f"reading {len(ranges)} byte range(s)",
            lambda fs, path: fs.cat_ranges(
                [path] * len(ranges), [r[0] for r in ranges], [r[1] for r in ranges], on_error="return"
            ),
        )
        failed = [(r, blob) for r, blob in zip(ranges, got, strict=True) if isinstance(blob, BaseException)]
        if failed:
            (start, end), err = failed[0]
            raise StoreReadError(
                f"{self}: bytes [{start}, {end}) could not be read ({len(failed)} of {len(ranges)} "
                f"ranges failed; {_tries(settings())}): {type(err).__name__}: {err}"
            ) from err
        return got

    def download_to(self, out) -> tuple[int, str]:
        """Stream this file or object into the open binary file `out`; returns (bytes, sha256) of what was
        written."""
        h, n = hashlib.sha256(), 0

        def copy(fs, path) -> None:
            nonlocal n
            with fs.open(path, "rb", block_size=HASH_BLOCK, cache_type="none") as src:
                while block := src.read(HASH_BLOCK):
                    out.write(block)
                    h.update(block)
                    n += len(block)

        self._call("reading it whole", copy)
        return n, h.hexdigest()

    def upload_file(self, local: Path, expected_sha256: str) -> None:
        """Copy a local file here, then read it back and check its sha256.

        Nothing may vouch for the object until this returns: callers write the manifest afterwards. A
        local destination gets a temp name renamed into place (fsspec's local copy writes in place)."""
        if self._local:
            dest = Path(self.url)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.upload")
            shutil.copyfile(local, tmp)
            os.replace(tmp, dest)
        else:
            self._call(f"uploading {local}", lambda fs, path: fs.put_file(str(local), path))
        digest = self.sha256()
        if digest != expected_sha256:
            raise UploadMismatch(
                f"{self}: sha256 read back from the store is {digest}, the uploaded file's is "
                f"{expected_sha256}; the object is not trusted (no manifest written)"
            )


def read_json(loc: "Location | os.PathLike | str"):
    """The JSON at a location or path; an error naming it when it is not JSON (cut off, garbled)."""
    loc = location(loc)
    return parse_json(loc.read_bytes(), loc)


def read_many(locs: Sequence[Location]) -> list[bytes]:
    """Several whole files of one file system; on a store, fetched concurrently in one call (fsspec `cat`)."""
    if not locs:
        return []
    first = locs[0]
    paths = [loc._fs()[1] for loc in locs]
    got = first._call(f"reading it and {len(locs) - 1} more objects", lambda fs, _: fs.cat(paths, on_error="raise"))
    return [got[p] for p in paths]
