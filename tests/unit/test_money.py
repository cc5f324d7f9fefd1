"""Money: one writer per request log, a cap that holds at any concurrency, paid-but-unusable replies booked,
and a run whose requests mostly failed is a failure naming the kinds. Real HTTP server on loopback."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from eagle3_dagster.contracts import Conversation
from eagle3_dagster.generate import RegenerationFailedError, ResponseStore, StoreLockedError
from eagle3_dagster.generate.client import OpenAIChatBackend
from eagle3_dagster.generate.regenerate import GenerationSettings, regenerate_dataset_sync
from eagle3_dagster.generate.store import iter_turns
from test_chat_client import SECRET, FakeOpenRouter

MODEL = "moonshotai/kimi-k2.5"


def _backend(server: FakeOpenRouter, **kw) -> OpenAIChatBackend:
    kw.setdefault("timeout_s", 5.0)
    return OpenAIChatBackend(server.url, MODEL, SECRET, backoff_initial_s=0.01, backoff_max_s=0.02, **kw)


def _convs(n: int) -> list[Conversation]:
    return [
        Conversation(id=f"c{i}", messages=({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": ""}))
        for i in range(n)
    ]


def _lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_a_second_writer_on_the_same_request_log_fails_at_once_and_sends_nothing(tmp_path):
    store = tmp_path / "raw.jsonl"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys
        from eagle3_dagster.generate.store import ResponseStore
        with ResponseStore({str(store)!r}):
            print("holding", flush=True)
            sys.stdin.read()  # until the test closes our stdin
    """),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        with FakeOpenRouter() as server:
            with pytest.raises(StoreLockedError, match="another run is writing this request log"):
                regenerate_dataset_sync(
                    _convs(4), store, _backend(server), GenerationSettings(model=MODEL), dataset="ds"
                )
            assert server.received == []
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    with ResponseStore(store):  # the lock goes with the process that held it
        pass


def test_the_budget_cap_holds_at_concurrency_16(tmp_path):
    store = tmp_path / "raw.jsonl"
    # worst case of a request: 32 tokens x $0.0003125 = $0.01, which is also what the server charges
    settings = GenerationSettings(
        model=MODEL, max_new_tokens=32, concurrency=16, budget_usd=0.035, price_per_completion_token=0.01 / 32
    )
    with FakeOpenRouter(delay_s=0.1, cost=0.01) as server:
        stats = regenerate_dataset_sync(_convs(40), store, _backend(server), settings, dataset="ds")
        assert server.max_in_flight >= 2  # requests really were concurrent
        again = regenerate_dataset_sync(_convs(40), store, _backend(server), settings, dataset="ds")
    assert stats.stopped_by_budget and again.stopped_by_budget and again.num_requests == 0
    assert len(server.received) == 3
    with ResponseStore(store) as log:
        assert log.recorded_cost_usd <= 0.035 and log.recorded_cost_usd == pytest.approx(0.03)


def test_without_usage_a_request_is_booked_at_its_bound_and_the_cap_still_holds(tmp_path):
    store = tmp_path / "raw.jsonl"
    settings = GenerationSettings(
        model=MODEL, max_new_tokens=32, concurrency=8, budget_usd=0.05, price_per_completion_token=0.01 / 32
    )
    with FakeOpenRouter(delay_s=0.05, report_usage=False) as server:
        stats = regenerate_dataset_sync(_convs(20), store, _backend(server), settings, dataset="ds")
    assert len(server.served) == 5 and stats.stopped_by_budget
    assert stats.cost_usd == pytest.approx(0.05)
    assert all(t["cost_usd"] == pytest.approx(0.01) and t["cost_reported"] is False for t in iter_turns(store))


@pytest.mark.parametrize("fault", ["truncated", "nochoices", "garbage"])
def test_a_paid_but_unusable_reply_is_booked_as_spent_and_never_silently_repaid(tmp_path, fault):
    store = tmp_path / "raw.jsonl"
    settings = GenerationSettings(
        model=MODEL,
        max_new_tokens=32,
        concurrency=1,
        budget_usd=1.0,
        price_per_completion_token=0.01 / 32,
        max_failure_fraction=1.0,
    )
    with FakeOpenRouter([fault]) as server:
        stats = regenerate_dataset_sync(_convs(1), store, _backend(server), settings, dataset="ds")
        assert len(server.received) == 1  # not re-sent behind the budget's back
        assert stats.failures_by_kind == {"unusable_reply": 1} and stats.num_paid_unusable == 1
        assert stats.cost_usd == pytest.approx(0.01)
        failed = [r for r in _lines(store) if r["type"] == "failed"]
        assert failed == [
            {
                "type": "failed",
                "request_id": failed[0]["request_id"],
                "kind": "unusable_reply",
                "cost_usd": pytest.approx(0.01),
            }
        ]
        again = regenerate_dataset_sync(_convs(1), store, _backend(server), settings, dataset="ds")
    # the next run may send it again, and both payments are on record
    assert again.num_successes == 1 and len(server.received) == 2
    with ResponseStore(store) as log:
        assert log.recorded_cost_usd == pytest.approx(0.01 + 0.001)


def test_a_run_whose_requests_all_failed_is_a_failure_naming_the_kinds(tmp_path):
    store = tmp_path / "raw.jsonl"
    with FakeOpenRouter(["500"] * 4 + ["echo_key"] * 2) as server:
        with pytest.raises(RegenerationFailedError) as err:
            regenerate_dataset_sync(
                _convs(3),
                store,
                _backend(server, max_retries=1),
                GenerationSettings(model=MODEL, concurrency=1),
                dataset="ds",
            )
    message = str(err.value)
    assert "3 of 3 requests failed" in message and "server_error: 2" in message and "client_error: 1" in message
    assert "max_failure_fraction" in message and SECRET not in message


def test_failures_below_the_fraction_do_not_fail_the_run(tmp_path):
    with FakeOpenRouter(["echo_key"]) as server:
        stats = regenerate_dataset_sync(
            _convs(4),
            tmp_path / "raw.jsonl",
            _backend(server),
            GenerationSettings(model=MODEL, concurrency=1, max_failure_fraction=0.25),
            dataset="ds",
        )
    assert stats.failures_by_kind == {"client_error": 1} and stats.num_successes == 3


def test_raw_responses_partitions_queue_behind_each_other_in_a_pool_of_one(micro_profile):
    import yaml

    from assets import raw_responses
    from eagle3_dagster.config import PROJECT_ROOT

    asset = raw_responses.for_profile(micro_profile)
    assert asset.op.pool == "raw_responses"
    instance = yaml.safe_load((PROJECT_ROOT / "dagster_home" / "dagster.yaml").read_text())
    assert instance["concurrency"]["pools"]["default_limit"] == 1
    # both commands set up their instance with scripts/instance.sh
    assert "concurrency set raw_responses 1" in (PROJECT_ROOT / "scripts" / "instance.sh").read_text()
    for script in ("ui.sh", "demo.sh"):
        assert "\nsource scripts/instance.sh\n" in (PROJECT_ROOT / "scripts" / script).read_text()
