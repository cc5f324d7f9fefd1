"""Regeneration turn by turn, budget, failure accounting and resume (also after SIGKILL), against a loopback server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import pytest

from eagle3_dagster.contracts import Conversation
from eagle3_dagster.data.prompts import load_conversations
from eagle3_dagster.generate.client import OpenAIChatBackend
from eagle3_dagster.generate.regenerate import GenerationSettings, regenerate_dataset_sync, request_id
from eagle3_dagster.generate.store import ResponseStore, iter_turns
from test_chat_client import SECRET, FakeOpenRouter

SETTINGS = GenerationSettings(model="moonshotai/kimi-k2.5", max_new_tokens=32, concurrency=1)


def _backend(server: FakeOpenRouter, **kw) -> OpenAIChatBackend:
    kw.setdefault("timeout_s", 2.0)
    return OpenAIChatBackend(server.url, SETTINGS.model, SECRET, backoff_initial_s=0.01, backoff_max_s=0.02, **kw)


def _convs(n: int, turns: int = 2) -> list[Conversation]:
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "be brief"}]
        for t in range(turns):
            msgs += [{"role": "user", "content": f"q{i}.{t}"}, {"role": "assistant", "content": f"OLD{i}.{t}"}]
        out.append(Conversation(id=f"c{i}", messages=tuple(msgs)))
    return out


def _lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_every_assistant_turn_is_replaced_and_fed_back_as_history(tmp_path):
    store = tmp_path / "raw.jsonl"
    lines: list[str] = []
    with FakeOpenRouter() as server:
        stats = regenerate_dataset_sync(
            _convs(1), store, _backend(server), SETTINGS, dataset="ds", progress=lines.append
        )
    # the shared progress contract (eagle3_dagster.progress), with the requests and money so far
    assert re.fullmatch(
        r"raw_responses\[ds\]: 1/1 conversations \(100\.0%\), [\d.,]+ conversations/s, "
        r"ETA 0:00:00, 2 requests, \$0\.0020",
        lines[-1],
    ), lines
    second = server.bodies[1]["messages"]
    assert second == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "q0.0"},
        {"role": "assistant", "content": "answer 0 to q0.0", "reasoning_content": "thinking about q0.0"},
        {"role": "user", "content": "q0.1"},
    ]
    turns = list(iter_turns(store))
    assert [t["turn"] for t in turns] == [0, 1]
    assert turns[1]["response"] == {
        "reasoning": "thinking about q0.1",
        "content": "answer 1 to q0.1",
        "tool_calls": [],
        "finish_reason": "stop",
    }
    assert turns[1]["messages"] == second and turns[1]["provider"] == "Moonshot AI"
    assert not any("OLD" in orjson.dumps(t).decode() for t in turns)
    assert stats.num_successes == 2 and stats.num_conversations_complete == 1
    assert stats.prompt_tokens == 22 and stats.completion_tokens == 14 and stats.reasoning_tokens == 6
    assert stats.cost_usd == pytest.approx(0.002)


def test_request_ids_are_deterministic_and_change_with_generation_settings():
    a = request_id("ds", "c0", 1, SETTINGS)
    assert a == request_id("ds", "c0", 1, GenerationSettings(model=SETTINGS.model, max_new_tokens=32, concurrency=9))
    assert a != request_id("ds", "c0", 1, GenerationSettings(model=SETTINGS.model, max_new_tokens=33))
    assert a != request_id("ds", "c0", 0, SETTINGS) != request_id("other", "c0", 1, SETTINGS)


def test_budget_stops_new_requests_and_a_restart_sends_none(tmp_path):
    store = tmp_path / "raw.jsonl"
    # each request reserves 256 x $0.00004 = $0.01024 and costs $0.01: four fit in $0.045, a fifth does not
    settings = GenerationSettings(
        model=SETTINGS.model, concurrency=3, budget_usd=0.045, price_per_completion_token=0.00004
    )
    with FakeOpenRouter(delay_s=0.2, cost=0.01) as server:
        stats = regenerate_dataset_sync(_convs(10, turns=1), store, _backend(server), settings, dataset="ds")
        assert stats.stopped_by_budget
        assert len(server.served) == 4
        assert len(list(iter_turns(store))) == 4 and stats.cost_usd == pytest.approx(0.04)
        again = regenerate_dataset_sync(_convs(10, turns=1), store, _backend(server), settings, dataset="ds")
    assert again.num_requests == 0 and again.stopped_by_budget and len(server.received) == 4


def test_a_turn_that_fails_for_good_is_counted_by_kind_and_retried_by_the_next_run(tmp_path):
    store = tmp_path / "raw.jsonl"
    tolerant = GenerationSettings(model=SETTINGS.model, max_new_tokens=32, concurrency=1, max_failure_fraction=1.0)
    with FakeOpenRouter(["500", "500", "429", "429"]) as server:
        stats = regenerate_dataset_sync(_convs(2), store, _backend(server, max_retries=1), tolerant, dataset="ds")
        # two attempts each: c0 gets 500, 500; c1 gets 429, 429
        assert stats.failures_by_kind == {"server_error": 1, "rate_limited": 1}
        assert stats.attempt_failures_by_kind == {"server_error": 2, "rate_limited": 2}
        assert stats.num_conversations_failed == 2 and stats.num_conversations_complete == 0
        assert stats.num_requests == 2 and list(iter_turns(store)) == []
        again = regenerate_dataset_sync(_convs(2), store, _backend(server), SETTINGS, dataset="ds")
    assert again.num_conversations_complete == 2 and again.num_requests == 4 and again.failures_by_kind == {}


def test_torn_last_line_is_truncated_counted_and_never_parsed(tmp_path):
    store = tmp_path / "raw.jsonl"
    with FakeOpenRouter() as server:
        regenerate_dataset_sync(_convs(1), store, _backend(server), SETTINGS, dataset="ds")
        good = store.read_bytes()
        store.write_bytes(good + b'{"type": "turn", "request_id": "abc", "respo')
        stats = regenerate_dataset_sync(_convs(2), store, _backend(server), SETTINGS, dataset="ds")
    assert stats.repaired_bytes == len(b'{"type": "turn", "request_id": "abc", "respo')
    assert stats.num_conversations_already_complete == 1 and stats.num_requests == 2
    assert store.read_bytes().startswith(good)
    assert all(line.endswith(b"}") for line in store.read_bytes().splitlines())


def test_a_garbled_line_in_the_middle_of_the_store_is_an_error_naming_the_line(tmp_path):
    store = tmp_path / "raw.jsonl"
    store.write_bytes(b'{"type": "sent", "request_id": "a"}\nGARBAGE\n{"type": "sent", "request_id": "b"}\n')
    with pytest.raises(ValueError, match="raw.jsonl:2"):
        ResponseStore(store)


def test_the_api_key_is_never_written_to_the_store(tmp_path):
    store = tmp_path / "raw.jsonl"
    with FakeOpenRouter(["echo_key"]) as server:
        regenerate_dataset_sync(
            _convs(2),
            store,
            _backend(server),
            GenerationSettings(model=SETTINGS.model, max_new_tokens=32, concurrency=1, max_failure_fraction=1.0),
            dataset="ds",
        )
    assert SECRET.encode() not in store.read_bytes()


_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from eagle3_dagster.data.prompts import load_conversations
    from eagle3_dagster.generate.client import OpenAIChatBackend
    from eagle3_dagster.generate.regenerate import GenerationSettings, regenerate_dataset_sync
    url, convs, store = sys.argv[1:]
    settings = GenerationSettings(model="moonshotai/kimi-k2.5", max_new_tokens=32, concurrency=2)
    stats = regenerate_dataset_sync(load_conversations(convs), Path(store),
                                    OpenAIChatBackend(url, settings.model, "sk-child"), settings, dataset="ds")
    print(stats.as_dict())
""")


def test_resume_after_sigkill_never_resends_a_request_and_loses_no_record(tmp_path):
    convs = tmp_path / "convs.jsonl"
    convs.write_bytes(
        b"".join(
            orjson.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"q{i}.{t}"} for t in range(3)]})
            + b"\n"
            for i in range(8)
        )
    )
    store = tmp_path / "raw.jsonl"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with FakeOpenRouter(delay_s=0.01, block_after=7) as server:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, server.url, str(convs), str(store)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 60
        while len(server.blocked) < 2 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.02)
        assert len(server.blocked) == 2, child.stderr.read().decode()[-2000:] if child.poll() is not None else ""
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        before = store.read_bytes()
        in_flight = set(server.blocked)
        server.block_after = None
        server.release.set()
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, server.url, str(convs), str(store)],
            env=env,
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert len(server.received) == len(set(server.received)), "a request id was sent twice"
    assert store.read_bytes().startswith(before), "records written before the kill were lost or changed"
    turns = {t["request_id"]: t for t in iter_turns(store)}
    assert set(server.served) == set(turns), "every answered request is recorded exactly once"
    assert in_flight.isdisjoint(turns)
    complete = [r for r in _lines(store) if r["type"] == "conversation"]
    assert len(complete) == 8 - 2  # the two conversations whose request died in flight stay incomplete
    assert all(rid in turns for c in complete for rid in c["request_ids"])
    assert sum(len(c["request_ids"]) for c in complete) == 6 * 3


def test_local_backend_regenerates_with_the_targets_chat_template(tmp_path, micro_target):
    from eagle3_dagster.generate.local_backend import LocalChatBackend

    backend = LocalChatBackend(micro_target)
    settings = GenerationSettings(model="micro", max_new_tokens=12, concurrency=1)
    convs = list(load_conversations_from([{"id": "a", "prompt": "Hello there"}], tmp_path))
    stats = regenerate_dataset_sync(convs, tmp_path / "raw.jsonl", backend, settings, dataset="local")
    (turn,) = list(iter_turns(tmp_path / "raw.jsonl"))
    assert turn["messages"] == [{"role": "user", "content": "Hello there"}]
    assert turn["provider"] == "local" and turn["cost_usd"] == 0.0
    assert 1 <= turn["usage"]["completion_tokens"] <= 12
    assert turn["response"]["finish_reason"] in {"stop", "length"}
    assert len(turn["response"]["completion_ids"]) == turn["usage"]["completion_tokens"]
    assert stats.num_successes == 1


def load_conversations_from(records: list[dict], tmp_path: Path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return load_conversations(path)
