"""Loading the local dataset files a profile names: prompts, finished conversations, pretokenized records.

Owns: turning `prompts_jsonl` / `conversations_jsonl` lines into `Conversation`s
(the shape `regenerate` and `tokenize` take) and streaming `pretokenized_jsonl`
records. Nothing is dropped silently: every line that is not used (not UTF-8,
not JSON, truncated, not an object, no or empty messages, duplicate id) is
counted by reason and handed to `on_reject` with its reason, `file:line` and
text, so the caller quarantines it and counts it toward the bad-fraction
threshold. The bundled ShareGPT file has
its own reader (`sharegpt.py`); ShareGPT-shaped lines (`conversations` of
`{from, value}`) in a jsonl file are normalised with the same rules.

Files are streamed line by line with orjson: a dataset is never held in memory.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from eagle3_dagster.contracts import Conversation
from eagle3_dagster.data.sharegpt import normalise_record

log = logging.getLogger(__name__)

_ROLES = {"system", "user", "assistant"}


@dataclass
class LoadStats:
    lines: int = 0
    loaded: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def num_rejected(self) -> int:
        return sum(self.skipped_by_reason.values())


@dataclass(frozen=True)
class Rejected:
    """An input line that was not used: why, where (`file:line`) and its text (undecodable bytes replaced)."""

    reason: str
    where: str
    raw: str


_MAX_RAW_CHARS = 2000


def _iter_lines(path: Path, stats: LoadStats, reject: Callable[[str, int, bytes], None]) -> Iterator[tuple[int, dict]]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            stats.lines += 1
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                reject(f"not_utf8: byte {e.start} is not UTF-8", lineno, line)
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                torn = not line.endswith(b"\n")
                reject(
                    f"truncated: the last line ends without a newline and does not parse ({e})"
                    if torn
                    else f"not_json: {e}",
                    lineno,
                    line,
                )
                continue
            if not isinstance(record, dict):
                reject("not_an_object", lineno, line)
                continue
            yield lineno, record


def _messages(record: dict) -> tuple[tuple[dict, ...] | None, str | None]:
    if isinstance(record.get("prompt"), str):
        msgs = [{"role": "user", "content": record["prompt"]}]
        if isinstance(record.get("system"), str):
            msgs.insert(0, {"role": "system", "content": record["system"]})
    elif isinstance(record.get("messages"), list):
        msgs = record["messages"]
        if not msgs:
            return None, "empty_messages"
    elif isinstance(record.get("conversations"), list):
        conv, reason = normalise_record({"id": str(record.get("id") or "x"), "conversations": record["conversations"]})
        return (conv.messages if conv else None), reason
    else:
        return None, "no_prompt_or_messages"
    out = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            return None, "bad_message"
        if m["role"] == "user" and not m["content"].strip():
            return None, "empty_message: a user turn has no content"
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in out):
        return None, "no_user_turn"
    return tuple(out), None


def _with_answer_slots(messages: tuple[dict, ...]) -> tuple[dict, ...]:
    """A prompt-only record gets an (empty) assistant slot after each user turn for the regenerator to fill."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        out.append(m)
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if m["role"] == "user" and nxt != "assistant":
            out.append({"role": "assistant", "content": ""})
    return tuple(out)


def load_conversations(
    path: str | Path,
    *,
    limit: int | None = None,
    stats: LoadStats | None = None,
    answer_slots: bool = True,
    on_reject: Callable[[Rejected], object] | None = None,
) -> Iterator[Conversation]:
    """Conversations from a `prompts_jsonl` or `conversations_jsonl` file.

    A line is `{"id", "prompt"[, "system"]}`, `{"id", "messages": [{role, content}]}` or ShareGPT's
    `{"id", "conversations": [{from, value}]}`. A missing id becomes the line number. With `answer_slots`
    (for regeneration), user turns with no assistant answer get an empty assistant slot, which is what
    regeneration replaces; without it (finished conversations) a trailing user turn is simply not
    supervised. Each unused line goes to `on_reject`, as it is met.
    """
    path = Path(path)
    stats = stats if stats is not None else LoadStats()
    skipped: Counter[str] = Counter()
    seen: set[str] = set()

    def reject(reason: str, lineno: int, line: bytes) -> None:
        skipped[reason.split(":")[0]] += 1
        if on_reject is not None:
            text = line.rstrip(b"\n").decode("utf-8", "replace")[:_MAX_RAW_CHARS]
            on_reject(Rejected(reason=reason, where=f"{path}:{lineno}", raw=text))

    try:
        for lineno, record in _iter_lines(path, stats, reject):
            messages, reason = _messages(record)
            conv_id = str(record.get("id") if record.get("id") not in (None, "") else lineno)
            if messages is None:
                reject(reason or "invalid", lineno, orjson.dumps(record))
                continue
            if conv_id in seen:
                reject(f"duplicate_id: {conv_id}", lineno, orjson.dumps(record))
                continue
            seen.add(conv_id)
            yield Conversation(id=conv_id, messages=_with_answer_slots(messages) if answer_slots else messages)
            stats.loaded += 1
            if limit is not None and stats.loaded >= limit:
                break
    finally:
        stats.skipped_by_reason = dict(skipped)
        if skipped:
            log.warning("%s: skipped %s", path, dict(skipped))


def iter_pretokenized(path: str | Path) -> Iterator[tuple[int, dict | None, bytes]]:
    """(line number, parsed record or None when the line is not a JSON object, raw line) for validation."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                record = None
            yield lineno, (record if isinstance(record, dict) else None), line.rstrip(b"\n")
