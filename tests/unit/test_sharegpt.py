"""The ShareGPT reader: streams the real (truncated) package file, normalises roles, counts what it skips."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from eagle3_dagster.data.sharegpt import (
    Conversation,
    ShareGPTReader,
    default_sharegpt_path,
    is_heldout,
    normalise_record,
    split_key,
)


@pytest.fixture(scope="module")
def real_file() -> Path:
    return default_sharegpt_path()


@pytest.fixture(scope="module")
def full_read(real_file):
    reader = ShareGPTReader(real_file)
    ids = [c.id for c in reader]
    return reader.stats, ids


def _write(tmp_path: Path, records: list, *, tail: bytes = b"\n]") -> Path:
    path = tmp_path / "sharegpt.json"
    body = b"[\n" + b",\n".join(json.dumps(r).encode() for r in records) + tail
    path.write_bytes(body)
    return path


def test_streams_first_conversations_of_real_file_with_normalised_roles(real_file):
    convs = list(ShareGPTReader(real_file, limit=50))
    assert len(convs) == 50
    assert all(isinstance(c, Conversation) and c.id for c in convs)
    for c in convs:
        assert {m["role"] for m in c.messages} <= {"system", "user", "assistant"}
        assert any(m["role"] == "user" for m in c.messages) and any(m["role"] == "assistant" for m in c.messages)
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in c.messages)
    assert convs[0].id == "QWJhYvA_0" and convs[0].messages[0]["content"].startswith("Summarize the main ideas")


def test_real_file_reports_truncation_at_the_byte_where_the_cut_record_starts(full_read, real_file):
    stats, ids = full_read
    assert stats.truncated_at_end is True
    size = real_file.stat().st_size
    assert 0 < stats.truncated_at_byte < size
    with open(real_file, "rb") as f:
        f.seek(stats.truncated_at_byte)
        tail = f.read()
    assert tail.startswith(b"{") and b"]" not in tail[-5:]
    with pytest.raises(json.JSONDecodeError):
        json.loads(tail)  # the cut record really is incomplete
    assert stats.records_read > 10_000
    assert stats.conversations_yielded == len(ids) == stats.records_read - sum(stats.malformed_by_reason.values())
    assert len(set(ids)) > 0.99 * len(ids)


def test_truncation_on_copy_of_real_tail_counts_only_complete_records(tmp_path, full_read, real_file, caplog):
    stats, _ = full_read
    with open(real_file, "rb") as f:
        f.seek(stats.truncated_at_byte)
        cut_record = f.read()
    records = [
        {"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
        for i in range(3)
    ]
    head = b"[\n" + b",\n".join(json.dumps(r).encode() for r in records) + b",\n  "
    path = tmp_path / "cut.json"
    path.write_bytes(head + cut_record)
    reader = ShareGPTReader(path)
    with caplog.at_level(logging.WARNING):
        got = [c.id for c in reader]
    assert got == ["r0", "r1", "r2"]
    assert reader.stats.records_read == 3
    assert reader.stats.truncated_at_end and reader.stats.truncated_at_byte == len(head)
    assert f"byte {len(head)}" in caplog.text


def test_complete_file_is_not_reported_truncated(tmp_path):
    path = _write(
        tmp_path, [{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]
    )
    reader = ShareGPTReader(path)
    assert [c.id for c in reader] == ["a"]
    assert reader.stats.truncated_at_end is False and reader.stats.truncated_at_byte is None


def test_roles_are_normalised_and_system_is_kept():
    conv, reason = normalise_record(
        {
            "id": "x",
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "q1"},
                {"from": "chatgpt", "value": "a1"},
                {"from": "user", "value": "q2"},
                {"from": "bing", "value": "a2"},
                {"from": "bard", "value": "a3"},
                {"from": "assistant", "value": "a4"},
                {"from": "gpt", "value": "a5"},
            ],
        }
    )
    assert reason is None
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user"] + ["assistant"] * 4


def test_malformed_conversations_are_skipped_and_counted_by_reason(tmp_path):
    ok = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    records = [
        {"id": "good", "conversations": ok},
        {"id": "empty", "conversations": []},
        {"id": "blank", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]},
        {"id": "nonstr", "conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "a"}]},
        {"id": "role", "conversations": [{"from": "robot", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"id": "nouser", "conversations": [{"from": "gpt", "value": "a"}]},
        {"id": "noasst", "conversations": [{"from": "human", "value": "q"}]},
        {"conversations": ok},
        ["not", "an", "object"],
        {"id": "good2", "conversations": ok},
    ]
    reader = ShareGPTReader(_write(tmp_path, records))
    assert [c.id for c in reader] == ["good", "good2"]
    assert reader.stats.records_read == len(records)
    assert reader.stats.malformed_by_reason == {
        "no_messages": 1,
        "empty_value": 2,
        "unknown_role": 1,
        "no_user_turn": 1,
        "no_assistant_turn": 1,
        "missing_id": 1,
        "not_an_object": 1,
    }


def test_heldout_split_is_a_fixed_sha256_function_of_the_id():
    for cid in ["QWJhYvA", "abc", "x" * 40]:
        expected = int.from_bytes(hashlib.sha256(cid.encode()).digest()[:8], "big") / 2**64 < 0.3
        assert is_heldout(cid, 0.3) is expected
    assert not is_heldout("anything", 0.0)
    assert split_key("QWJhYvA_12") == "QWJhYvA" and split_key("plain") == "plain"


@pytest.mark.slow  # reads the whole bundled ShareGPT file
def test_heldout_and_train_splits_are_disjoint_stable_and_cover_everything(real_file):
    n = 2000
    everything = [c.id for c in ShareGPTReader(real_file, limit=n)]
    read = lambda split: [c.id for c in ShareGPTReader(real_file, split=split, heldout_fraction=0.1)]  # noqa: E731  (a one-line helper of this test)
    train_reader = ShareGPTReader(real_file, split="train", heldout_fraction=0.1)
    train = [c.id for c in train_reader]
    heldout = read("heldout")
    assert train == read("train")  # stable between passes
    assert not set(train) & set(heldout)
    assert set(everything) <= set(train) | set(heldout)
    assert train_reader.stats.heldout_skipped == len(heldout)
    assert 0.05 < len(heldout) / (len(train) + len(heldout)) < 0.15
    roots = {split_key(i) for i in heldout}
    assert not roots & {split_key(i) for i in train}  # pieces of one conversation never straddle the split


def test_limit_stops_after_that_many_conversations(real_file):
    reader = ShareGPTReader(real_file, split="heldout", heldout_fraction=0.2, limit=7)
    assert len(list(reader)) == 7
    assert reader.stats.conversations_yielded == 7 and not reader.stats.truncated_at_end
