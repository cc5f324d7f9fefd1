"""Apply, verify and revert the hidden-state dump patch on a given interpreter's SGLang.

Owns: a strict unified-diff applier and the `patch apply|verify|revert --python
PATH` command. Which releases are supported, their pristine and patched sha256 and
their patch files come from `eagle3_dagster.sglang_releases` (generated from the
wheels by `patches/sglang/make_patch.py`); the dump logic lives in
`eagle3_dagster.sglang.dump_hook`.

SGLang is never imported here: the target interpreter runs `sglang.location`,
which says where its SGLang is and which version it is without importing it.
Every state is decided by sha256, so a file modified by anyone else is refused
rather than half-patched, and revert restores the pristine bytes exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

from eagle3_dagster import sglang_releases
from eagle3_dagster.gpu_host import program_argv
from eagle3_dagster.io import atomic_write_bytes
from eagle3_dagster.sglang import location

TARGET_RELPATH = "srt/models/deepseek_v2.py"


class PatchError(RuntimeError):
    """The patch cannot be applied/reverted; the message says why and what to do."""


def release_for(version: str) -> sglang_releases.Release:
    try:
        return sglang_releases.release(version)
    except sglang_releases.UnsupportedRelease as e:
        raise PatchError(str(e)) from None


def locate_sglang(python: str) -> tuple[str, Path]:
    """(version, path of deepseek_v2.py) of the SGLang that `python` would import."""
    try:
        proc = subprocess.run(program_argv(python, location), capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise PatchError(f"interpreter {python} does not exist") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise PatchError(f"interpreter {python} has no usable sglang: {last}")
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    return info["version"], Path(info["root"]) / TARGET_RELPATH


def file_state(version: str, data: bytes) -> str:
    """'patched', 'unpatched' or 'modified-unknown' for the bytes of a supported release's file."""
    return release_for(version).file_state(hashlib.sha256(data).hexdigest())


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def apply_unified_diff(text: str, diff: str, *, reverse: bool = False) -> str:
    """Apply (or un-apply) a unified diff whose context must match exactly: no fuzz, no offsets."""
    hunks: list[tuple[int, list[str], list[str]]] = []
    for line in diff.splitlines(keepends=True):
        if m := _HUNK.match(line):
            start = int(m.group(3) if reverse else m.group(1))
            hunks.append((start, [], []))
        elif hunks and line[:1] in (" ", "-", "+"):
            _, old, new = hunks[-1]
            body = line[1:]
            if line[0] in " -":
                old.append(body)
            if line[0] in " +":
                new.append(body)
    if not hunks:
        raise PatchError("patch file has no hunks")
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    pos = 0
    for start, old, new in hunks:
        if reverse:
            old, new = new, old
        at = start - 1 if old else start
        if lines[at : at + len(old)] != old:
            raise PatchError(f"patch context does not match at line {start}")
        out.extend(lines[pos:at])
        out.extend(new)
        pos = at + len(old)
    out.extend(lines[pos:])
    return "".join(out)


def _rewrite(path: Path, data: bytes) -> None:
    mode = path.stat().st_mode & 0o7777
    atomic_write_bytes(path, data)
    os.chmod(path, mode)  # atomic_write_bytes creates the temp file 0600


def apply(python: str) -> str:
    """Patch the interpreter's SGLang; returns what happened. Idempotent."""
    return _transition(python, reverse=False)


def revert(python: str) -> str:
    """Restore the pristine file byte for byte. Idempotent."""
    return _transition(python, reverse=True)


def _transition(python: str, *, reverse: bool) -> str:
    """Move the file to the patched (or pristine) state, checking the result by its sha256 before writing."""
    version, path = locate_sglang(python)
    release = release_for(version)
    data = path.read_bytes()
    state = file_state(version, data)
    done_state, verb = ("unpatched", "reverted") if reverse else ("patched", "patched")
    if state == done_state:
        return f"already {'pristine' if reverse else 'patched'}: {path} (sglang {version})"
    if state == "modified-unknown":
        raise PatchError(f"{path} differs from pristine sglang {version} and from the patched file; refusing")
    result = apply_unified_diff(data.decode(), release.patch_file.read_text(), reverse=reverse).encode()
    expected = release.pristine_sha256 if reverse else release.patched_sha256
    if hashlib.sha256(result).hexdigest() != expected:
        what = (
            f"reverting {path} did not restore the pristine"
            if reverse
            else f"{release.patch_file} did not produce the expected patched"
        )
        raise PatchError(f"{what} file for sglang {version}")
    _rewrite(path, result)
    return f"{verb}: {path} (sglang {version})"


def verify(python: str) -> str:
    """'patched', 'unpatched' or 'modified-unknown' for the interpreter's SGLang."""
    version, path = locate_sglang(python)
    return file_state(version, path.read_bytes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3 patch", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["apply", "verify", "revert"])
    parser.add_argument("--python", required=True, help="the interpreter whose SGLang is patched")
    args = parser.parse_args(argv)
    try:
        if args.action == "verify":
            state = verify(args.python)
            print(state)
            return 0 if state == "patched" else 1
        print(apply(args.python) if args.action == "apply" else revert(args.python))
        return 0
    except PatchError as e:
        print(f"error: {e}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
