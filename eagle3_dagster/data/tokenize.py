"""tokenized_dataset: exact token ids and assistant-only loss masks, one record per assistant turn.

Owns: turning regenerated turns (the `raw_responses` store), finished
conversations, or pretokenized records into `tokenized_data.jsonl` lines, the
quarantine side file, and the stage's stats. A line (and one of merged_train.jsonl):
`id` (unique across datasets: "{dataset}/{conversation_id}", + "/{turn}" when split),
`dataset`, `input_ids`, `loss_mask` (1 where the target generated the token, same
length), `source` (e.g. "regenerated:local", "sharegpt", "pretokenized"), and
`truncated` when merged_train cut it to max_seq_len.

How a turn becomes ids. The prompt is rendered by the target's own chat
template with the generation prompt (for Kimi it ends in `<think>`), the
completion is `render_completion(reasoning, content, tool_calls)`: exactly what
the target generated, through `<|im_end|>`. The two are tokenized *separately*
and concatenated: tokenizing the joined string could merge BPE pieces across
the boundary and change ids the model never saw. The loss mask is 1 on the
completion ids, 0 on the prompt.

Why one record per assistant turn (not one per conversation): Kimi's template
renders the reasoning of earlier turns as `<think></think>`, so a conversation
rendered once shows the model history it never produced for those turns. Each
turn's own record holds the history as the model saw it at inference; speculators
(`build_boundary_sample`), tinker and SpecForge's `expand_reasoning_conversations.py`
do the same.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from jinja2 import TemplateError

from eagle3_dagster.chat.kimi import render_completion
from eagle3_dagster.contracts import Conversation
from eagle3_dagster.data.prompts import iter_pretokenized
from eagle3_dagster.generate.store import iter_turns, set_aside_reason
from eagle3_dagster.io import atomic_open, iter_jsonl

log = logging.getLogger(__name__)


class BadDataError(ValueError):
    """More of a dataset failed validation than `bad_fraction_threshold` allows."""


@dataclass
class TokenizeStats:
    dataset: str
    num_inputs: int = 0  # turns, conversations' assistant turns, or pretokenized lines
    num_records: int = 0
    num_tokens: int = 0
    num_loss_tokens: int = 0
    num_dropped_length: int = 0  # finish_reason == "length": the answer was cut off
    num_quarantined: int = 0
    quarantine_by_reason: dict[str, int] = field(default_factory=dict)
    num_usage_checked: int = 0
    num_usage_mismatch: int = 0  # rebuilt completion length != usage.completion_tokens (beyond tolerance)
    num_exact_completion_ids: int = 0  # turns whose completion ids came from the backend, not re-tokenized
    num_set_aside: int = 0  # turns of another producer (target, served model or tokenizer): not tokenized
    set_aside_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def usage_mismatch_rate(self) -> float:
        return self.num_usage_mismatch / self.num_usage_checked if self.num_usage_checked else 0.0

    @property
    def bad_fraction(self) -> float:
        return self.num_quarantined / self.num_inputs if self.num_inputs else 0.0

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "usage_mismatch_rate": round(self.usage_mismatch_rate, 4),
            "bad_fraction": round(self.bad_fraction, 4),
        }


def encode(tokenizer, text: str) -> list[int]:
    """Ids of `text` with special-token strings as their single ids and nothing added (no BOS)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_turn_sample(
    tokenizer,
    prompt_messages: list[dict],
    reasoning: str | None,
    content: str | None,
    tool_calls: list[dict] | None,
    *,
    thinking: bool = True,
    tools: list[dict] | None = None,
    completion_ids: list[int] | None = None,
) -> tuple[list[int], list[int], int]:
    """(input_ids, loss_mask, completion length) of one generated turn after its exact prompt.

    `completion_ids`, when the backend reported them, are used as they are: they are what the target
    generated, which re-tokenizing the rendered text need not reproduce."""
    prompt = tokenizer.apply_chat_template(
        prompt_messages, tools=tools, add_generation_prompt=True, tokenize=False, thinking=thinking
    )
    prompt_ids = encode(tokenizer, prompt)
    if completion_ids is None:
        completion_ids = encode(tokenizer, render_completion(reasoning, content, tool_calls, thinking=thinking))
    else:
        bad = [t for t in completion_ids if not isinstance(t, int) or not 0 <= t < len(tokenizer)]
        if bad:
            raise ValueError(f"completion_ids hold ids outside the vocab: {bad[:5]}")
    return prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids), len(completion_ids)


class _TooBad(Exception):
    pass


class _Writer:
    """Writes records and quarantined inputs atomically; the threshold check runs before either is published."""

    def __init__(self, out_path: Path, quarantine_path: Path, stats: TokenizeStats, threshold: float) -> None:
        self.out_path, self.quarantine_path, self.stats, self.threshold = out_path, quarantine_path, stats, threshold
        self.reasons: Counter[str] = Counter()

    def run(self, items: Iterable[tuple[str, Any]]) -> TokenizeStats:
        """`items` yields ("record", dict) or ("bad", (reason, where, raw input))."""
        too_bad = False
        with atomic_open(self.quarantine_path) as bad:  # published even on failure: it is the evidence
            try:
                with atomic_open(self.out_path) as out:
                    for kind, item in items:
                        if kind == "record":
                            out.write(orjson.dumps(item) + b"\n")
                            self.stats.num_records += 1
                            self.stats.num_tokens += len(item["input_ids"])
                            self.stats.num_loss_tokens += sum(item["loss_mask"])
                        else:
                            reason, where, raw = item
                            self.reasons[reason] += 1
                            self.stats.num_quarantined += 1
                            bad.write(orjson.dumps({"reason": reason, "where": where, "input": raw}) + b"\n")
                    self.stats.quarantine_by_reason = dict(self.reasons)
                    if self.stats.bad_fraction > self.threshold:
                        raise _TooBad  # leaves the output unpublished
            except _TooBad:
                too_bad = True
        if too_bad:
            raise BadDataError(
                f"{self.stats.dataset}: {self.stats.num_quarantined}/{self.stats.num_inputs} inputs are bad "
                f"({self.stats.bad_fraction:.1%} > bad_fraction_threshold {self.threshold:.1%}): "
                f"{dict(self.reasons)}; see {self.quarantine_path}"
            )
        if self.stats.num_quarantined:
            log.warning(
                "%s: quarantined %d inputs %s -> %s",
                self.stats.dataset,
                self.stats.num_quarantined,
                dict(self.reasons),
                self.quarantine_path,
            )
        return self.stats


def _source_rejects(rejects: list | deque | None, stats: TokenizeStats) -> Iterator[tuple[str, object]]:
    """Input lines the loader did not use (`prompts.Rejected`), as quarantine items counted as inputs."""
    while rejects:
        r = rejects.pop(0) if isinstance(rejects, list) else rejects.popleft()
        stats.num_inputs += 1
        yield "bad", (r.reason, r.where, r.raw)


def _rejects_file(path: Path | None, stats: TokenizeStats) -> Iterator[tuple[str, object]]:
    """The input lines raw_responses quarantined from its source file (one JSON object per line)."""
    if path is None or not Path(path).exists():
        return
    for q in iter_jsonl(path):
        stats.num_inputs += 1
        yield "bad", (q["reason"], q["where"], q["input"])


def tokenize_regenerated(
    store_path: Path,
    tokenizer,
    out_path: Path,
    quarantine_path: Path,
    *,
    dataset: str,
    bad_fraction_threshold: float = 0.05,
    usage_tolerance: int = 1,
    source_rejects_path: Path | Sequence[Path] | None = None,
    producer: dict | None = None,
) -> TokenizeStats:
    """One record per regenerated turn of the `raw_responses` store; cut-off answers dropped and counted.
    Source lines raw_responses could not use (`source_rejects_path`) are quarantined here too and count.
    With a `producer`, turns recorded under another one (another target, served model or tokenizer: their
    ids would mean other tokens) are set aside and counted by reason, never tokenized."""
    stats = TokenizeStats(dataset=dataset)
    set_aside: Counter[str] = Counter()

    def items() -> Iterator[tuple[str, object]]:
        paths = [source_rejects_path] if isinstance(source_rejects_path, (str, Path)) else source_rejects_path or []
        for path in paths:
            yield from _rejects_file(path, stats)
        for turn in iter_turns(store_path):
            if producer is not None and turn.get("producer") != producer:
                set_aside[set_aside_reason(turn.get("producer"), producer)] += 1
                stats.num_set_aside += 1
                stats.set_aside_by_reason = dict(set_aside)
                continue
            stats.num_inputs += 1
            where = f"{store_path}:request {turn.get('request_id')}"
            response = turn.get("response") or {}
            if response.get("finish_reason") == "length":
                stats.num_dropped_length += 1
                continue
            thinking = bool((turn.get("settings") or {}).get("reasoning", True))
            try:
                ids, mask, n_completion = build_turn_sample(
                    tokenizer,
                    turn["messages"],
                    response.get("reasoning"),
                    response.get("content"),
                    response.get("tool_calls"),
                    thinking=thinking,
                    completion_ids=response.get("completion_ids"),
                )
            except (KeyError, TypeError, ValueError, TemplateError) as e:
                yield "bad", (f"unrenderable: {type(e).__name__}: {e}"[:200], where, turn)
                continue
            stats.num_exact_completion_ids += "completion_ids" in response
            reported = (turn.get("usage") or {}).get("completion_tokens")
            if isinstance(reported, int):
                stats.num_usage_checked += 1
                # Providers differ on whether the closing <|im_end|> is counted: allow `usage_tolerance`.
                if abs(n_completion - reported) > usage_tolerance:
                    stats.num_usage_mismatch += 1
            yield (
                "record",
                {
                    "id": f"{dataset}/{turn['conversation_id']}/{turn['turn']}",
                    "dataset": dataset,
                    "input_ids": ids,
                    "loss_mask": mask,
                    "source": f"regenerated:{turn.get('provider') or 'unknown'}",
                    "request_id": turn["request_id"],
                },
            )

    stats = _Writer(out_path, quarantine_path, stats, bad_fraction_threshold).run(items())
    if stats.num_set_aside:
        log.warning(
            "%s: %d turns of %s set aside, not tokenized: %s",
            dataset,
            stats.num_set_aside,
            store_path,
            stats.set_aside_by_reason,
        )
    if stats.num_usage_checked:
        log.info(
            "%s: completion length matches usage.completion_tokens for %d/%d turns",
            dataset,
            stats.num_usage_checked - stats.num_usage_mismatch,
            stats.num_usage_checked,
        )
    return stats


def tokenize_conversations(
    conversations: Iterable[Conversation],
    tokenizer,
    out_path: Path,
    quarantine_path: Path,
    *,
    dataset: str,
    source: str,
    max_turns: int | None = None,
    bad_fraction_threshold: float = 0.05,
    source_rejects: list | deque | None = None,
) -> TokenizeStats:
    """Finished conversations (no regeneration): each assistant turn supervised after its own prompt.

    `source_rejects` is filled by the loader (`load_conversations(on_reject=...)`) as it reads; each
    rejected line is quarantined and counted as an input, so garbage lines count toward the threshold."""
    stats = TokenizeStats(dataset=dataset)

    def items() -> Iterator[tuple[str, object]]:
        for conv in conversations:
            yield from _source_rejects(source_rejects, stats)
            turn = 0
            for j, message in enumerate(conv.messages):
                if message["role"] != "assistant" or (max_turns is not None and turn >= max_turns):
                    continue
                stats.num_inputs += 1
                history = list(conv.messages[:j])
                if not history or history[-1]["role"] != "user" or not message.get("content"):
                    yield (
                        "bad",
                        (
                            "assistant turn without a user turn before it, or empty",
                            f"{conv.id} message {j}",
                            {"id": conv.id, "messages": list(conv.messages)},
                        ),
                    )
                    continue
                try:
                    ids, mask, _ = build_turn_sample(
                        tokenizer,
                        history,
                        message.get("reasoning_content"),
                        message["content"],
                        message.get("tool_calls"),
                    )
                except (KeyError, TypeError, ValueError, TemplateError) as e:  # the template raised on it
                    yield (
                        "bad",
                        (
                            f"chat_template: {type(e).__name__}: {e}"[:300],
                            f"{conv.id} message {j}",
                            {"id": conv.id, "messages": list(conv.messages)},
                        ),
                    )
                    continue
                yield (
                    "record",
                    {
                        "id": f"{dataset}/{conv.id}/{turn}",
                        "dataset": dataset,
                        "input_ids": ids,
                        "loss_mask": mask,
                        "source": source,
                    },
                )
                turn += 1
        yield from _source_rejects(source_rejects, stats)

    return _Writer(out_path, quarantine_path, stats, bad_fraction_threshold).run(items())


def validate_pretokenized(record: dict | None, vocab_size: int) -> str | None:
    """Why a pretokenized record is unusable, or None when it is fine."""
    if record is None:
        return "not a JSON object"
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list):
        return "input_ids and loss_mask must be lists"
    if not ids:
        return "empty input_ids"
    if len(ids) != len(mask):
        return f"loss_mask length {len(mask)} != input_ids length {len(ids)}"
    if not all(type(i) is int and 0 <= i < vocab_size for i in ids):
        return f"input_ids outside [0, {vocab_size}) or not integers"
    if not all(m in (0, 1) and type(m) in (int, bool) for m in mask):
        return "loss_mask values must be 0/1"
    if not any(mask):
        return "no loss tokens"
    return None


def normalize_pretokenized(
    in_path: Path,
    out_path: Path,
    quarantine_path: Path,
    *,
    dataset: str,
    vocab_size: int,
    bad_fraction_threshold: float = 0.05,
) -> TokenizeStats:
    """Validate records that arrive tokenized; good ones are rewritten in the contract's shape."""
    stats = TokenizeStats(dataset=dataset)
    seen: set[str] = set()

    def items() -> Iterator[tuple[str, object]]:
        for lineno, record, raw in iter_pretokenized(in_path):
            stats.num_inputs += 1
            reason = validate_pretokenized(record, vocab_size)
            rid = f"{dataset}/{record.get('id', lineno) if record else lineno}"
            if reason is None and rid in seen:
                reason = f"duplicate id {rid}"
            if reason:
                yield "bad", (reason, f"{in_path}:{lineno}", raw.decode("utf-8", "replace")[:2000])
                continue
            assert record is not None  # validate_pretokenized names a reason for every missing record
            seen.add(rid)
            yield (
                "record",
                {
                    "id": rid,
                    "dataset": dataset,
                    "input_ids": record["input_ids"],
                    "loss_mask": [int(m) for m in record["loss_mask"]],
                    "source": "pretokenized",
                },
            )

    return _Writer(out_path, quarantine_path, stats, bad_fraction_threshold).run(items())
