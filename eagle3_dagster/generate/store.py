"""Append-only, resumable JSONL store of regenerated turns, keyed by request id.

Owns: the on-disk log of one `raw_responses` partition and the rules that make
a killed run safe to restart. It does not talk to any server (`client.py`) and
does not decide what to request (`regenerate.py`).

The log holds three kinds of lines, each a JSON object with a `type`:

- `sent`: written (and fsynced) *before* a request leaves the process. A `sent`
  id with no `turn` line after a crash is a request that may have been paid for
  but whose answer was lost; the regenerator never re-sends it unless told to.
- `turn`: one regenerated assistant turn: the exact prompt messages it was
  generated from, the response (reasoning, content, tool_calls, finish_reason),
  usage, cost and provider.
- `failed`: a sent request that failed for good (after retries); it may be sent
  again by a later run, as its answer never arrived. A failure the provider was
  paid for (an HTTP 200 whose answer is unusable) carries its `cost_usd`, which
  counts toward the budget like a turn's.
- `conversation`: all turns of a conversation are recorded.

One writer per log: opening the store takes an exclusive `flock` on it, held
until it is closed (the kernel drops it when the process dies). A second run on
the same partition fails at once with `StoreLockedError` instead of paying for
the same requests again.

A crash can tear the last line. Opening the store detects a last line without
its newline (or one that does not parse), truncates it away, logs it and counts
it in `repaired_bytes`; a torn line is never parsed as a record.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger(__name__)


class StoreCorruptError(ValueError):
    """A line in the middle of the store (not a torn tail) is not a valid record."""


class StoreLockedError(RuntimeError):
    """Another process is writing this request log."""


class ResponseStore:
    """The log of one partition. Holds only offsets in memory, so it scales with request count, not bytes."""

    def __init__(self, path: str | os.PathLike, *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.repaired_bytes = 0
        self.recorded_cost_usd = 0.0  # what every recorded turn cost, so a budget holds across restarts
        self._turn_offsets: dict[str, tuple[int, int]] = {}  # request id -> (offset, length)
        self._sent: set[str] = set()
        self._complete: set[str] = set()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = -1
            raise StoreLockedError(
                f"{self.path}: another run is writing this request log right now (it holds the log's lock); "
                f"wait for it to finish or cancel it: two writers would pay for the same requests twice"
            ) from None
        try:
            self._repair_and_index()
        except BaseException:
            self.close()
            raise

    # -- reading -------------------------------------------------------------------------------------

    def _repair_and_index(self) -> None:
        if not self.path.exists():
            return
        good_end = 0
        with open(self.path, "rb") as f:
            lineno = 0
            while True:
                line = f.readline()
                if not line:
                    break
                lineno += 1
                start = good_end
                if not line.endswith(b"\n"):
                    break  # torn tail: no newline means the write never finished
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError:
                    if f.peek(1):
                        raise StoreCorruptError(
                            f"{self.path}:{lineno}: not a JSON record in the middle of the store"
                        ) from None
                    break  # last line garbled by the crash: treat as torn
                good_end = start + len(line)
                self._index(record, start, len(line), lineno)
        size = self.path.stat().st_size
        if size > good_end:
            self.repaired_bytes = size - good_end
            log.warning("%s: torn last line (%d bytes) from an interrupted run truncated away", self.path, size - good_end)
            os.truncate(self.path, good_end)

    def _index(self, record: Any, offset: int, length: int, lineno: int) -> None:
        kind = record.get("type") if isinstance(record, dict) else None
        rid = record.get("request_id") if isinstance(record, dict) else None
        if kind == "sent" and isinstance(rid, str):
            self._sent.add(rid)
        elif kind == "turn" and isinstance(rid, str):
            self._turn_offsets[rid] = (offset, length)
            self.recorded_cost_usd += float(record.get("cost_usd") or 0.0)
        elif kind == "failed" and isinstance(rid, str):
            self._sent.discard(rid)
            self.recorded_cost_usd += float(record.get("cost_usd") or 0.0)
        elif kind == "conversation":
            self._complete.add(str(record.get("conversation_id")))
        else:
            raise StoreCorruptError(f"{self.path}:{lineno}: record without a known type/request_id")

    def has_turn(self, request_id: str) -> bool:
        return request_id in self._turn_offsets

    def is_interrupted(self, request_id: str) -> bool:
        """Sent by an earlier run that died before its answer was recorded."""
        return request_id in self._sent and request_id not in self._turn_offsets

    def is_complete(self, conversation_id: str) -> bool:
        return conversation_id in self._complete

    def get_turn(self, request_id: str) -> dict:
        offset, length = self._turn_offsets[request_id]
        with open(self.path, "rb") as f:
            f.seek(offset)
            return orjson.loads(f.read(length))

    @property
    def num_turns(self) -> int:
        return len(self._turn_offsets)


    # -- writing -------------------------------------------------------------------------------------

    def _append(self, record: dict) -> tuple[int, int]:
        line = orjson.dumps(record) + b"\n"
        offset = os.lseek(self._fd, 0, os.SEEK_END)
        # One write() of the whole line on an O_APPEND descriptor: a crash leaves at most one torn tail.
        written = os.write(self._fd, line)
        if written != len(line):
            raise OSError(f"{self.path}: short write ({written} of {len(line)} bytes)")
        if self.fsync:
            os.fsync(self._fd)
        return offset, len(line)

    def mark_sent(self, request_id: str) -> None:
        self._append({"type": "sent", "request_id": request_id})
        self._sent.add(request_id)

    def mark_failed(self, request_id: str, kind: str, cost_usd: float = 0.0) -> None:
        record: dict = {"type": "failed", "request_id": request_id, "kind": kind}
        if cost_usd:
            record["cost_usd"] = cost_usd
        self._append(record)
        self._sent.discard(request_id)
        self.recorded_cost_usd += cost_usd

    def add_turn(self, record: dict) -> None:
        rid = record["request_id"]
        if rid in self._turn_offsets:
            raise ValueError(f"{self.path}: request {rid} is already recorded")
        self._turn_offsets[rid] = self._append({"type": "turn", **record})
        self.recorded_cost_usd += float(record.get("cost_usd") or 0.0)

    def mark_complete(self, conversation_id: str, request_ids: list[str]) -> None:
        self._append({"type": "conversation", "conversation_id": conversation_id, "request_ids": request_ids})
        self._complete.add(conversation_id)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ResponseStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_turns(path: str | os.PathLike) -> Iterator[dict]:
    """The recorded turns of a store, in write order (torn tail ignored, never parsed)."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                return
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                raise StoreCorruptError(f"{path}:{lineno}: not a JSON record") from None
            if record.get("type") == "turn":
                yield record
