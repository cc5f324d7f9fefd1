"""Exact token ids and loss masks, checked token by token against sequences built by hand from the markers."""

from __future__ import annotations

import orjson
import pytest
from transformers import AutoTokenizer

from eagle3_dagster.contracts import Conversation
from eagle3_dagster.data.tokenize import (
    BadDataError,
    build_turn_sample,
    normalize_pretokenized,
    tokenize_conversations,
    tokenize_regenerated,
)
from eagle3_dagster.generate.store import ResponseStore
from eagle3_dagster.io import iter_jsonl

SYSTEM = {"role": "system", "content": "Be brief."}
WEATHER_CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
}


@pytest.fixture(scope="module")
def tok(micro_target):
    return AutoTokenizer.from_pretrained(micro_target)


def hand(tok, *pieces: str) -> list[int]:
    """Ids built piece by piece: a marker is its single special id, any other piece is encoded on its own."""
    ids: list[int] = []
    for p in pieces:
        if (
            p.startswith("<")
            and p.endswith(">")
            and p in tok.get_vocab()
            and len(tok.encode(p, add_special_tokens=False)) == 1
        ):
            ids.append(tok.convert_tokens_to_ids(p))
        else:
            ids.extend(tok.encode(p, add_special_tokens=False))
    return ids


def prompt_pieces(*turns: tuple[str, str]) -> list[str]:
    out = []
    for role, body in turns:
        out += [f"<|im_{role}|>", role, "<|im_middle|>", *body.split("\0"), "<|im_end|>"]
    return out + ["<|im_assistant|>", "assistant", "<|im_middle|>", "<think>"]


def test_reasoning_turn_is_prompt_unsupervised_then_exactly_the_generated_tokens_supervised(tok):
    ids, mask, n = build_turn_sample(
        tok, [SYSTEM, {"role": "user", "content": "Hi there"}], "Let me think.", "Hello!", None
    )
    prompt = hand(tok, *prompt_pieces(("system", "Be brief."), ("user", "Hi there")))
    completion = hand(tok, "Let me think.", "</think>", "Hello!", "<|im_end|>")
    assert ids == prompt + completion
    assert mask == [0] * len(prompt) + [1] * len(completion)
    assert n == len(completion)


def test_tool_call_section_is_supervised_marker_by_marker(tok):
    ids, mask, _ = build_turn_sample(
        tok, [SYSTEM, {"role": "user", "content": "weather?"}], "Need a tool.", "", [WEATHER_CALL]
    )
    prompt = hand(tok, *prompt_pieces(("system", "Be brief."), ("user", "weather?")))
    completion = hand(
        tok,
        "Need a tool.",
        "</think>",
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "functions.get_weather:0",
        "<|tool_call_argument_begin|>",
        '{"city":"Paris"}',
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        "<|im_end|>",
    )
    assert ids == prompt + completion
    assert [i for i, m in zip(ids, mask) if m] == completion


def _store_with(tmp_path, turns: list[dict]):
    path = tmp_path / "raw.jsonl"
    with ResponseStore(path, fsync=False) as store:
        for t in turns:
            store.add_turn({"dataset": "ds", "provider": "local", "settings": {"reasoning": True}, **t})
    return path


def _turn(rid, conv, turn, messages, reasoning, content, *, finish="stop", completion_tokens=None, tool_calls=()):
    return {
        "request_id": rid,
        "conversation_id": conv,
        "turn": turn,
        "messages": messages,
        "response": {
            "reasoning": reasoning,
            "content": content,
            "tool_calls": list(tool_calls),
            "finish_reason": finish,
        },
        "usage": {} if completion_tokens is None else {"completion_tokens": completion_tokens},
    }


def test_multi_turn_gives_one_record_per_turn_with_earlier_reasoning_dropped_as_the_template_does(tmp_path, tok):
    first = [SYSTEM, {"role": "user", "content": "One"}]
    second = first + [
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Two"},
    ]
    store = _store_with(tmp_path, [_turn("r0", "c", 0, first, "R1", "A1"), _turn("r1", "c", 1, second, "R2", "A2")])
    stats = tokenize_regenerated(store, tok, tmp_path / "tok.jsonl", tmp_path / "q.jsonl", dataset="ds")
    r0, r1 = list(iter_jsonl(tmp_path / "tok.jsonl"))
    assert (r0["id"], r1["id"]) == ("ds/c/0", "ds/c/1")
    prompt = hand(
        tok,
        "<|im_system|>",
        "system",
        "<|im_middle|>",
        "Be brief.",
        "<|im_end|>",
        "<|im_user|>",
        "user",
        "<|im_middle|>",
        "One",
        "<|im_end|>",
        "<|im_assistant|>",
        "assistant",
        "<|im_middle|>",
        "<think>",
        "</think>",
        "A1",
        "<|im_end|>",
        "<|im_user|>",
        "user",
        "<|im_middle|>",
        "Two",
        "<|im_end|>",
        "<|im_assistant|>",
        "assistant",
        "<|im_middle|>",
        "<think>",
    )
    completion = hand(tok, "R2", "</think>", "A2", "<|im_end|>")
    assert r1["input_ids"] == prompt + completion
    assert r1["loss_mask"] == [0] * len(prompt) + [1] * len(completion)
    assert stats.num_records == 2 and stats.num_loss_tokens == sum(r0["loss_mask"]) + len(completion)


def test_cut_off_turns_are_dropped_and_usage_mismatches_counted(tmp_path, tok):
    msgs = [SYSTEM, {"role": "user", "content": "Hi"}]
    n = len(hand(tok, "R", "</think>", "Hello", "<|im_end|>"))
    store = _store_with(
        tmp_path,
        [
            _turn("a", "c1", 0, msgs, "R", "Hello", completion_tokens=n),
            _turn("b", "c2", 0, msgs, "R", "Hello", completion_tokens=n - 1),  # provider did not count <|im_end|>
            _turn("c", "c3", 0, msgs, "R", "Hello", completion_tokens=n + 5),
            _turn("d", "c4", 0, msgs, "R", "Hel", finish="length", completion_tokens=3),
        ],
    )
    stats = tokenize_regenerated(store, tok, tmp_path / "tok.jsonl", tmp_path / "q.jsonl", dataset="ds")
    assert stats.num_inputs == 4 and stats.num_records == 3 and stats.num_dropped_length == 1
    assert stats.num_usage_checked == 3 and stats.num_usage_mismatch == 1
    assert stats.usage_mismatch_rate == pytest.approx(1 / 3)


def test_finished_conversations_supervise_each_assistant_turn_after_its_own_prompt(tmp_path, tok):
    conv = Conversation(
        id="x", messages=(SYSTEM, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "Ans"})
    )
    stats = tokenize_conversations(
        [conv], tok, tmp_path / "tok.jsonl", tmp_path / "q.jsonl", dataset="sg", source="sharegpt"
    )
    (rec,) = list(iter_jsonl(tmp_path / "tok.jsonl"))
    completion = hand(tok, "</think>", "Ans", "<|im_end|>")
    assert rec["input_ids"][-len(completion) :] == completion and sum(rec["loss_mask"]) == len(completion)
    assert rec["id"] == "sg/x/0" and rec["source"] == "sharegpt" and stats.num_records == 1


def _write(path, lines):
    path.write_bytes(b"".join((line if isinstance(line, bytes) else orjson.dumps(line)) + b"\n" for line in lines))


BAD_PRETOKENIZED = [
    ({"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, None),
    ({"id": "b", "input_ids": [1, 2, 999], "loss_mask": [0, 1, 1]}, "outside"),
    ({"id": "c", "input_ids": [1, 2], "loss_mask": [0, 1, 1]}, "length"),
    ({"id": "d", "input_ids": [1, 2], "loss_mask": [0, 2]}, "0/1"),
    ({"id": "e", "input_ids": [1, 2], "loss_mask": [0, 0]}, "no loss tokens"),
    ({"id": "f", "input_ids": [], "loss_mask": []}, "empty"),
    (b"{not json", "not a JSON object"),
]


def test_bad_pretokenized_records_are_quarantined_with_their_reason(tmp_path):
    src = tmp_path / "in.jsonl"
    _write(src, [r for r, _ in BAD_PRETOKENIZED])
    stats = normalize_pretokenized(
        src, tmp_path / "tok.jsonl", tmp_path / "q.jsonl", dataset="pt", vocab_size=100, bad_fraction_threshold=1.0
    )
    (good,) = list(iter_jsonl(tmp_path / "tok.jsonl"))
    assert good == {
        "id": "pt/a",
        "dataset": "pt",
        "input_ids": [1, 2, 3],
        "loss_mask": [0, 1, 1],
        "source": "pretokenized",
    }
    reasons = [q["reason"] for q in iter_jsonl(tmp_path / "q.jsonl")]
    assert len(reasons) == 6 and stats.num_quarantined == 6
    for reason, (_, expected) in zip(reasons, BAD_PRETOKENIZED[1:]):
        assert expected in reason


def test_too_many_bad_records_fail_the_stage_without_publishing_the_output(tmp_path):
    src = tmp_path / "in.jsonl"
    _write(src, [r for r, _ in BAD_PRETOKENIZED])
    with pytest.raises(BadDataError, match=r"6/7 inputs are bad"):
        normalize_pretokenized(
            src, tmp_path / "tok.jsonl", tmp_path / "q.jsonl", dataset="pt", vocab_size=100, bad_fraction_threshold=0.05
        )
    assert not (tmp_path / "tok.jsonl").exists()
    assert len(list(iter_jsonl(tmp_path / "q.jsonl"))) == 6


def test_completion_ids_reported_by_the_backend_are_supervised_as_generated_not_retokenized(tmp_path, tok):
    msgs = [SYSTEM, {"role": "user", "content": "Hi"}]
    canonical = hand(tok, "R", "</think>", "Hello", "<|im_end|>")
    # what a model may really emit: "Hello" spelled one byte-level piece at a time
    spelled = hand(tok, "R", "</think>") + [tok.convert_tokens_to_ids(c) for c in "Hello"] + hand(tok, "<|im_end|>")
    assert spelled != canonical and tok.decode(spelled) == tok.decode(canonical)
    turn = _turn("a", "c1", 0, msgs, "R", "Hello", completion_tokens=len(spelled))
    turn["response"]["completion_ids"] = spelled
    stats = tokenize_regenerated(
        _store_with(tmp_path, [turn]), tok, tmp_path / "tok.jsonl", tmp_path / "q.jsonl", dataset="ds"
    )
    (record,) = list(iter_jsonl(tmp_path / "tok.jsonl"))
    assert record["input_ids"][-len(spelled) :] == spelled
    assert record["loss_mask"] == [0] * (len(record["input_ids"]) - len(spelled)) + [1] * len(spelled)
    assert stats.num_exact_completion_ids == 1 and stats.num_usage_mismatch == 0


def test_completion_ids_outside_the_vocab_are_quarantined(tmp_path, tok):
    turn = _turn("a", "c1", 0, [SYSTEM, {"role": "user", "content": "Hi"}], "R", "Hello")
    turn["response"]["completion_ids"] = [5, len(tok) + 7]
    turn2 = _turn("b", "c2", 0, [SYSTEM, {"role": "user", "content": "Hi"}], "R", "Hello")
    stats = tokenize_regenerated(
        _store_with(tmp_path, [turn, turn2]),
        tok,
        tmp_path / "tok.jsonl",
        tmp_path / "q.jsonl",
        dataset="ds",
        bad_fraction_threshold=0.9,
    )
    assert stats.num_quarantined == 1 and stats.num_records == 1
    assert "outside the vocab" in (tmp_path / "q.jsonl").read_text()
