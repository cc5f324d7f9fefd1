"""Bad input lines in prompt and conversation files are quarantined with their reason and count toward the
bad-fraction threshold; a clean conversation ending with a user turn is not bad; turns cut to fit the context
are counted."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import orjson
import pytest

from eagle3_dagster.data.prompts import LoadStats, load_conversations
from eagle3_dagster.data.sharegpt import Conversation
from eagle3_dagster.data.tokenize import BadDataError, tokenize_conversations
from eagle3_dagster.stages.data import RegenerateSettings

GOOD = {"id": "good", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _file(tmp_path: Path, lines: list[bytes], tail: bytes = b"") -> Path:
    path = tmp_path / "conversations.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines) + tail)
    return path


BAD_LINES = {
    "not_json": b'{"id": "x", "messages": [',
    "not_utf8": b'{"id": "y", "prompt": "caf\xe9"}',
    "empty_messages": b'{"id": "z", "messages": []}',
    "empty_message": b'{"id": "w", "messages": [{"role": "user", "content": "  "}]}',
    "not_an_object": b"[1, 2]",
}


def test_every_rejected_line_is_handed_over_with_its_reason_and_line(tmp_path):
    lines = [orjson.dumps(GOOD)] + list(BAD_LINES.values())
    path = _file(tmp_path, lines, tail=b'{"id": "cut", "messages": [{"role": "us')  # truncated last line
    rejects, stats = [], LoadStats()
    convs = list(load_conversations(path, stats=stats, on_reject=rejects.append))
    assert [c.id for c in convs] == ["good"]
    assert [r.reason.split(":")[0] for r in rejects] == [*BAD_LINES, "truncated"]
    assert [r.where for r in rejects] == [f"{path}:{i}" for i in range(2, 8)]
    assert "caf\ufffd" in rejects[1].raw  # undecodable bytes shown replaced, never dropped
    assert sum(stats.skipped_by_reason.values()) == 6 and stats.lines == 7


def test_a_conversation_ending_with_a_user_turn_is_not_quarantined(tmp_path, micro_target):
    from transformers import AutoTokenizer

    record = {
        "id": "ends_with_user",
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "thanks, bye"},
        ],
    }
    path = _file(tmp_path, [orjson.dumps(record)])
    convs = list(load_conversations(path, answer_slots=False))
    assert convs[0].messages[-1] == {"role": "user", "content": "thanks, bye"}
    tokenizer = AutoTokenizer.from_pretrained(micro_target)
    stats = tokenize_conversations(
        convs,
        tokenizer,
        tmp_path / "out.jsonl",
        tmp_path / "q.jsonl",
        dataset="ds",
        source="conversations_jsonl",
        bad_fraction_threshold=0.0,
    )
    assert stats.num_records == 1 and stats.num_quarantined == 0


def test_rejected_lines_are_quarantined_and_fail_the_threshold(tmp_path, micro_target):
    from transformers import AutoTokenizer

    path = _file(tmp_path, [orjson.dumps(GOOD | {"id": f"g{i}"}) for i in range(2)] + list(BAD_LINES.values()))
    rejects: deque = deque()
    convs = load_conversations(path, answer_slots=False, on_reject=rejects.append)
    tokenizer = AutoTokenizer.from_pretrained(micro_target)
    quarantine = tmp_path / "q.jsonl"
    with pytest.raises(BadDataError, match="5/7 inputs are bad"):
        tokenize_conversations(
            convs,
            tokenizer,
            tmp_path / "out.jsonl",
            quarantine,
            dataset="ds",
            source="conversations_jsonl",
            bad_fraction_threshold=0.5,
            source_rejects=rejects,
        )
    quarantined = [orjson.loads(line) for line in quarantine.read_bytes().splitlines()]
    assert [q["reason"].split(":")[0] for q in quarantined] == list(BAD_LINES)
    assert all(q["where"].startswith(f"{path}:") for q in quarantined)
    assert not (tmp_path / "out.jsonl").exists()


def test_turns_cut_to_fit_the_context_are_counted(micro_target, micro_profile):
    from transformers import AutoTokenizer

    from eagle3_dagster.stages.data import _fit_to_context

    tokenizer = AutoTokenizer.from_pretrained(micro_target)
    messages = []
    for t in range(30):
        messages += [
            {"role": "user", "content": f"question number {t} about things"},
            {"role": "assistant", "content": f"answer number {t}"},
        ]
    fitted, num_cut = _fit_to_context(Conversation(id="long", messages=tuple(messages)), tokenizer, budget=120)
    kept = sum(m["role"] == "assistant" for m in fitted.messages)
    assert 1 <= kept < 30 and num_cut == 30 - kept


def test_raw_responses_quarantines_bad_prompt_lines_and_spends_nothing_above_the_threshold(tmp_path, micro_target):
    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import ArtifactLayout
    from eagle3_dagster.stages.data import regenerate_partition, source_rejects_path
    from test_chat_client import FakeOpenRouter

    prompts = _file(tmp_path, [orjson.dumps({"id": "p0", "prompt": "hi"})] + list(BAD_LINES.values()))
    with FakeOpenRouter() as server:
        profile = load_profile(
            "micro",
            overrides={
                "run_root": str(tmp_path / "run"),
                "target": {"kind": "external", "path": str(micro_target)},
                "datasets": [{"name": "p", "source": "prompts_jsonl", "path": str(prompts)}],
                "generation": {"backend": "openai", "base_url": server.url, "model": "m"},
                "data": {"bad_fraction_threshold": 0.5},
            },
        )
        layout = ArtifactLayout.from_profile(profile)
        with pytest.raises(BadDataError, match="5/6") as err:
            regenerate_partition(RegenerateSettings.from_profile(profile), "p", layout, api_key="sk-test")
        assert server.received == []
    assert "data.bad_fraction_threshold" in str(err.value)
    quarantined = [orjson.loads(line) for line in source_rejects_path(layout, "p").read_bytes().splitlines()]
    assert [q["reason"].split(":")[0] for q in quarantined] == list(BAD_LINES)
