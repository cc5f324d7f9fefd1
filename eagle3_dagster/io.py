"""File primitives every stage shares: atomic writes, streaming JSONL, and file names read from foreign files.

Nothing half-written is ever read as complete: every artifact is written under
a temporary name in the same folder and renamed into place (rename is atomic on
POSIX within one file system). A file name that another program or person wrote
(a safetensors index's `weight_map`, a published `export_manifest.json`) is
joined to its folder only through `confined_path`, and read only as a `regular_file`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import hashlib
import logging
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import IO, Any

import orjson

log = logging.getLogger(__name__)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temp file beside `path`; on clean exit fsync and rename it over `path`.

    The temp name carries this host and pid, so temp files that a killed writer left (SIGKILL, OOM) are
    recognised and removed by the next writer of the same path. A full disk is a `DiskFullError` naming
    `path` and the space left."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    with naming_full_disk(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{writer_tag()}.", suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the result gets the mode open() would give it
            with os.fdopen(fd, mode) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def writer_tag() -> str:
    """`HOST-PID`: what every temp file's name carries after `.NAME.`, so `remove_stale_temps` can tell whose
    it is (atomic_open's `.NAME.HOST-PID.XXXX.tmp`, a hidden-state shard's `.NAME.HOST-PID.tmp`)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def remove_stale_temps(path: Path) -> int:
    """Remove the temp files of `path` left by writers on this host that are no longer alive; their count.
    A temp of a live writer, or of another host (a shared file system: its pid means nothing here), is
    left alone."""
    prefix = f".{path.name}.{socket.gethostname()}-"
    removed = 0
    for tmp in path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = tmp.name[len(prefix) :].split(".", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        with contextlib.suppress(FileNotFoundError):
            size = tmp.stat().st_size
            tmp.unlink()
            removed += 1
            log.warning("%s: removed %s (%d bytes), left by a writer that was killed", path, tmp.name, size)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DiskFullError(OSError):
    """No space left on the device where a file was being written; says which file and how much is free."""


def _free_bytes(path: str | os.PathLike) -> tuple[Path, int]:
    where = Path(path).parent
    while not where.exists() and where != where.parent:
        where = where.parent
    return where, shutil.disk_usage(where).free


def disk_full_error(path: str | os.PathLike, e: BaseException) -> DiskFullError:
    where, free = _free_bytes(path)
    cause = "" if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) else f"; {type(e).__name__}: {e}"
    return DiskFullError(
        errno.ENOSPC,
        f"no space left on the device while writing {path} ({free / 2**20:.1f} MiB "
        f"free in {where}{cause}): free space there, or move run_root to a larger disk",
    )


# A writer that reports a full disk without its errno (torch.save: "basic_ios::clear: iostream error") is
# taken for one when less than this is left where it wrote.
NEARLY_FULL_BYTES = 16 << 20


@contextlib.contextmanager
def naming_full_disk(
    path: str | os.PathLike, *, unnamed_errors: tuple[type[BaseException], ...] = ()
) -> Iterator[None]:
    """Turn ENOSPC/EDQUOT (which name no file) into a `DiskFullError` naming `path` and the free space; an
    error of `unnamed_errors` too, when the disk there is (nearly) full."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT) or (
            isinstance(e, unnamed_errors) and _free_bytes(path)[1] < NEARLY_FULL_BYTES
        ):
            raise disk_full_error(path, e) from e
        raise
    except unnamed_errors as e:
        if _free_bytes(path)[1] < NEARLY_FULL_BYTES:
            raise disk_full_error(path, e) from e
        raise


@functools.cache
def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; set it straight back
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def json_bytes(obj: Any) -> bytes:
    """The project's JSON files: indented, keys sorted (same object -> same bytes, so sizes can be predicted)."""
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, json_bytes(obj))


def parse_json(blob: bytes, where: str | os.PathLike) -> Any:
    """The JSON in `blob`, read from `where`; an error that names `where` when it is not JSON (cut off, garbled)."""
    try:
        return orjson.loads(blob)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({len(blob)} bytes; {e})") from None


def iter_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Stream records; a line that does not parse is an error naming the file and line number."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON record ({e})") from None


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Write all records atomically; returns how many were written."""
    n = 0
    with atomic_open(path, "wb") as f:
        for r in records:
            f.write(orjson.dumps(r))
            f.write(b"\n")
            n += 1
    return n


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class ForeignInputError(ValueError):
    """A value read from a file this project did not write (a drafter trained elsewhere, a published manifest)
    that it refuses; the message names the file and the field or entry."""


def confined_path(
    root: str | os.PathLike, name: object, *, where: str, flat: bool = False, links_out: bool = False
) -> Path:
    """`root / name` for a `name` read from a foreign file (`where`: that file and entry, for the error).

    The name must be a relative POSIX path without a `..` component (a bare file name when `flat`), and
    `root / name`, symlinks followed, must stay inside `root` (also followed): `../x`, `/etc/x`, `a/../../x`
    and a link out of the folder are each a `ForeignInputError` naming `where`. `links_out`: a link out of the
    folder is allowed (a folder whose files are links by design: a hub cache's snapshot, whose files link to
    `../../blobs/`); the name itself is still checked."""
    pure = PurePosixPath(name) if isinstance(name, str) and "\0" not in name else None
    if pure is None or not pure.parts:
        raise ForeignInputError(f"{where}: {name!r} is not a file name; refused")
    if pure.is_absolute() or ".." in pure.parts:
        raise ForeignInputError(
            f"{where}: file name {name!r} is absolute or has a '..' component, which can lead out of {root}; refused"
        )
    if flat and len(pure.parts) != 1:
        raise ForeignInputError(f"{where}: {name!r} is not a bare file name in {root}; refused")
    root_real = Path(root).resolve()
    path = Path(root) / pure
    if not links_out and not path.resolve().is_relative_to(root_real):
        raise ForeignInputError(f"{where}: {path} leads out of {root} (to {path.resolve()}) through a symlink; refused")
    return path


def regular_file(path: str | os.PathLike, *, where: str) -> Path:
    """`path` when it is an existing regular file (after symlinks): never a device (`/dev/urandom` reads
    forever), a FIFO (blocks) or a folder. A `ForeignInputError` naming `where` otherwise; a missing file is
    a `FileNotFoundError`."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: {path} does not exist") from None
    if not stat.S_ISREG(mode):
        kind = (
            "a folder"
            if stat.S_ISDIR(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a FIFO"
            if stat.S_ISFIFO(mode)
            else "not a regular file"
        )
        raise ForeignInputError(
            f"{where}: {path} is {kind}"
            + (f" ({path.resolve()})" if path.is_symlink() else "")
            + ", not a regular file; refused"
        )
    return path
