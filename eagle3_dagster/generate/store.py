"""Append-only, resumable JSONL store of regenerated turns, keyed by request id.

Owns: the on-disk log of one `raw_responses` partition and the rules that make
a killed run safe to restart. It does not talk to any server (`client.py`) and
does not decide what to request (`regenerate.py`).

The log holds three kinds of lines, each a JSON object with a `type`:

- `sent`: written (and fsynced) *before* a try leaves the process, with the try's
  worst-case cost `bound_usd`. Until a `turn` or `failed` line of its id settles
  it, a try counts at its bound: after a crash it may have been paid for while
  its answer was lost, and the regenerator never re-sends it unless told to. A
  second `sent` of the same id (a retry after a timeout) leaves the earlier try
  booked at its bound for good: no answer of the provider will ever settle it.
- `turn`: one regenerated assistant turn: the exact prompt messages it was
  generated from, the response (reasoning, content, tool_calls, finish_reason),
  usage, cost and provider. It settles the id's latest try at `cost_usd`.
- `failed`: a sent request that failed for good (after retries), settling its
  latest try at `cost_usd`: zero when the provider refused it (429, 5xx), the
  reported cost of a paid but unusable answer, the bound of a try that timed out
  after reaching the provider (`maybe_paid`). A failed request may be sent again
  by a later run, except a `maybe_paid` one (unless told to).
- `conversation`: all turns of a conversation are recorded, by which producer.

Every turn carries its `producer`: the identity of the model and the tokenizer
that produced it (`target.answer_producer`). A turn or a finished conversation
of another producer is there, counted by `turns_by_producer`, but is never the
current producer's (`set_aside_reason` says why).

One writer per log: opening the store takes an exclusive `flock` on it, held
until it is closed (the kernel drops it when the process dies). A second run on
the same partition fails at once with `StoreLockedError` instead of paying for
the same requests again.

A crash can tear the last line. Opening the store detects a last line without
its newline (or one that does not parse), truncates it away, logs it and counts
it in `repaired_bytes`; a torn line is never parsed as a record.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from eagle3_dagster.generate.budget import usd_amount
from eagle3_dagster.io import naming_full_disk

log = logging.getLogger(__name__)


def producer_key(producer: dict | None) -> str:
    """A producer as a comparable string ("" for turns written before turns carried one)."""
    return orjson.dumps(producer, option=orjson.OPT_SORT_KEYS).decode() if producer else ""


def set_aside_reason(recorded: dict | None, current: dict) -> str:
    """Why an answer recorded under `recorded` is not one of `current`'s, e.g. 'another tokenizer'."""
    if not recorded:
        return "no producer recorded (written before answers carried the model and tokenizer identity)"
    changed = sorted(k for k in set(recorded) | set(current) if recorded.get(k) != current.get(k))
    return "another " + " and ".join(changed)


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
        # What every try on record cost, unsettled ones at their bound, so a budget holds across restarts.
        self.recorded_cost_usd = 0.0
        self._turn_offsets: dict[str, tuple[int, int]] = {}  # request id -> (offset, length)
        self._unsettled: dict[str, float] = {}  # request id -> bound of its latest try, sent and not answered
        self._maybe_paid: set[str] = set()  # failed after reaching the provider: may be paid, answer lost
        self._complete: set[tuple[str, str]] = set()  # (conversation id, producer key)
        self.turns_by_producer: Counter[str] = Counter()  # producer key -> turns on record
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
            log.warning(
                "%s: torn last line (%d bytes) from an interrupted run truncated away", self.path, size - good_end
            )
            os.truncate(self.path, good_end)

    def _index(self, record: Any, offset: int, length: int, lineno: int) -> None:
        kind = record.get("type") if isinstance(record, dict) else None
        rid = record.get("request_id") if isinstance(record, dict) else None
        if kind == "sent" and isinstance(rid, str):
            self._book_sent(rid, float(record.get("bound_usd") or 0.0))
        elif kind == "turn" and isinstance(rid, str):
            self._turn_offsets[rid] = (offset, length)
            self._settle(rid, self._cost_on_record(record, rid, lineno))
            self.turns_by_producer[producer_key(record.get("producer"))] += 1
        elif kind == "failed" and isinstance(rid, str):
            self._settle(rid, self._cost_on_record(record, rid, lineno), maybe_paid=bool(record.get("maybe_paid")))
        elif kind == "conversation":
            self._complete.add((str(record.get("conversation_id")), producer_key(record.get("producer"))))
        else:
            raise StoreCorruptError(f"{self.path}:{lineno}: record without a known type/request_id")

    def _cost_on_record(self, record: dict, rid: str, lineno: int) -> float:
        """A settling line's `cost_usd` (absent: 0). One that is not an amount (null, negative, a string: what
        logs written before the regenerator checked a provider's `usage.cost` may hold; orjson writes NaN and
        infinity as null) counts the try at its bound, as if it had never been answered."""
        if "cost_usd" not in record:
            return 0.0
        amount = usd_amount(record["cost_usd"])
        if amount is None:
            amount = self._unsettled.get(rid, 0.0)
            log.warning(
                "%s:%d: request %s has cost_usd %r on record, not an amount; counted at its bound $%.6f",
                self.path,
                lineno,
                rid,
                record["cost_usd"],
                amount,
            )
        return amount

    def has_turn(self, request_id: str) -> bool:
        return request_id in self._turn_offsets

    def is_interrupted(self, request_id: str) -> bool:
        """Sent by an earlier run that died before its answer was recorded."""
        return request_id in self._unsettled and request_id not in self._turn_offsets

    def is_maybe_paid(self, request_id: str) -> bool:
        """Failed for good after a try reached the provider (a timeout): it may be paid, its answer is lost."""
        return request_id in self._maybe_paid and request_id not in self._turn_offsets

    @property
    def unsettled_usd(self) -> float:
        """The bounds of the tries sent and never answered (in flight now, or when an earlier run died)."""
        return sum(self._unsettled.values())

    def _book_sent(self, request_id: str, bound_usd: float) -> None:
        # an earlier unsettled try of this id keeps its bound in recorded_cost_usd for good
        self._unsettled[request_id] = bound_usd
        self.recorded_cost_usd += bound_usd

    def _settle(self, request_id: str, cost_usd: float, *, maybe_paid: bool = False) -> None:
        self.recorded_cost_usd += cost_usd - self._unsettled.pop(request_id, 0.0)
        if maybe_paid:
            self._maybe_paid.add(request_id)
        else:
            self._maybe_paid.discard(request_id)

    def is_complete(self, conversation_id: str, producer: dict | None = None) -> bool:
        return (conversation_id, producer_key(producer)) in self._complete

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
        with naming_full_disk(self.path):
            offset = os.lseek(self._fd, 0, os.SEEK_END)
            # One write() of the whole line on an O_APPEND descriptor: a crash leaves at most one torn tail.
            written = os.write(self._fd, line)
            if written != len(line):  # a partial line is a torn tail the next open truncates away
                raise OSError(errno.ENOSPC, f"{self.path}: short write ({written} of {len(line)} bytes)")
            if self.fsync:
                os.fsync(self._fd)
        return offset, len(line)

    def mark_sent(self, request_id: str, bound_usd: float = 0.0) -> None:
        """Before a try leaves: from here on it counts at `bound_usd` until an answer settles it."""
        record: dict = {"type": "sent", "request_id": request_id}
        if bound_usd:
            record["bound_usd"] = bound_usd
        self._append(record)
        self._book_sent(request_id, bound_usd)

    def mark_failed(self, request_id: str, kind: str, cost_usd: float = 0.0, *, maybe_paid: bool = False) -> None:
        record: dict = {"type": "failed", "request_id": request_id, "kind": kind}
        if cost_usd:
            record["cost_usd"] = cost_usd
        if maybe_paid:
            record["maybe_paid"] = True
        self._append(record)
        self._settle(request_id, cost_usd, maybe_paid=maybe_paid)

    def add_turn(self, record: dict) -> None:
        rid = record["request_id"]
        if rid in self._turn_offsets:
            raise ValueError(f"{self.path}: request {rid} is already recorded")
        self._turn_offsets[rid] = self._append({"type": "turn", **record})
        self._settle(rid, float(record.get("cost_usd") or 0.0))
        self.turns_by_producer[producer_key(record.get("producer"))] += 1

    def mark_complete(self, conversation_id: str, request_ids: list[str], producer: dict | None = None) -> None:
        record: dict = {"type": "conversation", "conversation_id": conversation_id, "request_ids": request_ids}
        if producer:
            record["producer"] = producer
        self._append(record)
        self._complete.add((conversation_id, producer_key(producer)))

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
