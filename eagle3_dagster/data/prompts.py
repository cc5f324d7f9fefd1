"""Loading the local dataset files a profile names: prompts, finished conversations, pretokenized records.

Owns: turning `prompts_jsonl` / `conversations_jsonl` lines into `Conversation`s
(the shape `regenerate` and `tokenize` take) and streaming `pretokenized_jsonl`
records, with a count of what was skipped and why. The bundled ShareGPT file has
its own reader (`sharegpt.py`); ShareGPT-shaped lines (`conversations` of
`{from, value}`) in a jsonl file are normalised with the same rules.

Files are streamed line by line with orjson: a dataset is never held in memory.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from eagle3_dagster.data.sharegpt import Conversation, normalise_record

log = logging.getLogger(__name__)

_ROLES = {"system", "user", "assistant"}


@dataclass
class LoadStats:
    lines: int = 0
    loaded: int = 0
    skipped_by_reason: dict[str, int] = field(default_factory=dict)


def _iter_lines(path: Path, stats: LoadStats, skipped: Counter) -> Iterator[tuple[int, dict]]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            stats.lines += 1
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError:
                skipped["not_json"] += 1
                log.warning("%s:%d: not a JSON record; skipped", path, lineno)
                continue
            if not isinstance(record, dict):
                skipped["not_an_object"] += 1
                continue
            yield lineno, record


def _messages(record: dict) -> tuple[tuple[dict, ...] | None, str | None]:
    if isinstance(record.get("prompt"), str):
        msgs = [{"role": "user", "content": record["prompt"]}]
        if isinstance(record.get("system"), str):
            msgs.insert(0, {"role": "system", "content": record["system"]})
    elif isinstance(record.get("messages"), list):
        msgs = record["messages"]
    elif isinstance(record.get("conversations"), list):
        conv, reason = normalise_record({"id": str(record.get("id") or "x"), "conversations": record["conversations"]})
        return (conv.messages if conv else None), reason
    else:
        return None, "no_prompt_or_messages"
    out = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            return None, "bad_message"
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


def load_conversations(path: str | Path, *, limit: int | None = None,
                       stats: LoadStats | None = None) -> Iterator[Conversation]:
    """Conversations from a `prompts_jsonl` or `conversations_jsonl` file.

    A line is `{"id", "prompt"[, "system"]}`, `{"id", "messages": [{role, content}]}` or ShareGPT's
    `{"id", "conversations": [{from, value}]}`. A missing id becomes the line number. User turns with no
    assistant answer get an empty assistant slot, which is what regeneration replaces.
    """
    path = Path(path)
    stats = stats if stats is not None else LoadStats()
    skipped: Counter[str] = Counter()
    seen: set[str] = set()
    try:
        for lineno, record in _iter_lines(path, stats, skipped):
            messages, reason = _messages(record)
            conv_id = str(record.get("id") if record.get("id") not in (None, "") else lineno)
            if messages is None:
                skipped[reason or "invalid"] += 1
                continue
            if conv_id in seen:
                skipped["duplicate_id"] += 1
                continue
            seen.add(conv_id)
            yield Conversation(id=conv_id, messages=_with_answer_slots(messages))
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
