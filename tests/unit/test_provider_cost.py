"""A provider's `usage` is foreign input: a cost or token count that is not a non-negative finite number is
booked at the request's bound (the most it could have cost), counted, and named in a warning, so the spend on
record never falls below what was billed and the cap holds across runs. Real HTTP server on loopback."""

from __future__ import annotations

import json
import logging
import math
from http.server import BaseHTTPRequestHandler

import pytest

from eagle3_dagster.generate import ResponseStore
from eagle3_dagster.generate.client import OpenAIChatBackend, parse_chat_response
from eagle3_dagster.generate.regenerate import GenerationSettings, regenerate_dataset_sync
from eagle3_dagster.generate.store import iter_turns
from tests.loopback_http import LoopbackHTTPServer
from test_chat_client import SECRET, FakeOpenRouter
from test_money import MODEL, _convs

BILLED_USD = 0.01  # what the provider really charges each request: its bound (32 tokens x 0.01/32)
CAP_USD = 0.10
BAD_COSTS = [-0.01, float("nan"), float("inf"), "abc"]
BAD_IDS = ["negative", "nan", "inf", "string"]


def _settings(**kw) -> GenerationSettings:
    return GenerationSettings(
        model=MODEL, max_new_tokens=32, price_per_completion_token=BILLED_USD / 32, budget_usd=CAP_USD, **kw
    )


def _backend(url: str) -> OpenAIChatBackend:
    return OpenAIChatBackend(url, MODEL, SECRET, timeout_s=5.0, backoff_initial_s=0.01, backoff_max_s=0.02)


@pytest.mark.parametrize("cost", BAD_COSTS, ids=BAD_IDS)
def test_a_reported_cost_that_is_not_an_amount_is_booked_at_the_bound_and_the_cap_holds_across_two_runs(
    tmp_path, caplog, cost
):
    store = tmp_path / "raw.jsonl"
    with caplog.at_level(logging.WARNING, logger="eagle3_dagster.generate"):
        with FakeOpenRouter(cost=cost) as server:
            first = regenerate_dataset_sync(
                _convs(6), store, _backend(server.url), _settings(concurrency=8), dataset="ds"
            )
            second = regenerate_dataset_sync(
                _convs(40), store, _backend(server.url), _settings(concurrency=8), dataset="ds"
            )
    billed = len(server.served) * BILLED_USD
    with ResponseStore(store) as log:
        recorded = log.recorded_cost_usd
    assert billed <= recorded + 1e-9 and recorded <= CAP_USD + 1e-9, (billed, recorded)
    assert len(server.served) == 10 and second.stopped_by_budget
    assert first.num_replies_usage_malformed == first.num_successes == 6
    assert second.num_replies_usage_malformed == 4
    assert first.cost_usd == pytest.approx(0.06) and second.recorded_cost_usd == pytest.approx(CAP_USD)
    turns = list(iter_turns(store))
    assert all(t["cost_usd"] == pytest.approx(BILLED_USD) and t["cost_reported"] is False for t in turns)
    warned = [r.getMessage() for r in caplog.records if "usage.cost" in r.getMessage()]
    assert len(warned) == 10 and all(SECRET not in w for w in warned)
    assert any(t["request_id"] in w for t in turns for w in warned)  # the line names the request


@pytest.mark.parametrize("key", [SECRET, "sk-or-v1-" + "0123456789abcdef" * 4], ids=["short", "long"])
def test_a_malformed_usage_value_that_echoes_the_api_key_is_not_logged(tmp_path, caplog, key):
    with caplog.at_level(logging.WARNING, logger="eagle3_dagster.generate"):
        with _Provider({"completion_tokens": 1, "cost": key}) as server:
            backend = OpenAIChatBackend(server.url, MODEL, key, timeout_s=5.0)
            stats = regenerate_dataset_sync(
                _convs(1), tmp_path / "raw.jsonl", backend, _settings(concurrency=1), dataset="ds"
            )
    assert stats.num_replies_usage_malformed == 1 and "usage.cost" in caplog.text
    assert key[:16] not in caplog.text and key[:16] not in (tmp_path / "raw.jsonl").read_text()


def test_the_malformed_count_is_in_the_stats_the_stage_reports(tmp_path):
    with FakeOpenRouter(cost="abc") as server:
        stats = regenerate_dataset_sync(
            _convs(2), tmp_path / "raw.jsonl", _backend(server.url), _settings(concurrency=1), dataset="ds"
        )
    assert stats.as_dict()["num_replies_usage_malformed"] == 2


@pytest.mark.parametrize("cost", BAD_COSTS + [True], ids=BAD_IDS + ["bool"])
def test_parsing_a_reply_keeps_no_cost_that_is_not_an_amount_and_names_the_field(cost):
    body = {
        "choices": [{"finish_reason": "stop", "message": {"content": "x"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cost": cost},
    }
    result = parse_chat_response(body)
    assert result.cost is None and len(result.usage_problems) == 1 and "usage.cost" in result.usage_problems[0]
    assert result.usage == {"prompt_tokens": 3, "completion_tokens": 2}


@pytest.mark.parametrize(
    "field,value",
    [("completion_tokens", -5), ("prompt_tokens", "many"), ("completion_tokens", 2.5), ("prompt_tokens", float("nan"))],
)
def test_a_token_count_that_is_not_a_count_is_dropped_and_named(field, value):
    body = {
        "choices": [{"finish_reason": "stop", "message": {"content": "x"}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, field: value},
    }
    result = parse_chat_response(body)
    assert field not in result.usage and result.usage_problems and f"usage.{field}" in result.usage_problems[0]


def test_good_usage_is_kept_as_reported():
    body = {
        "choices": [{"finish_reason": "stop", "message": {"content": "x"}}],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "total_tokens": 5,
            "cost": 0,
            "completion_tokens_details": {"reasoning_tokens": None},
        },
    }
    result = parse_chat_response(body)
    assert (
        result.cost == 0.0
        and result.usage_problems == ()
        and result.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    )


@pytest.mark.parametrize("tokens", [-1000, "abc"], ids=["negative", "string"])
def test_without_a_cost_a_reply_whose_token_counts_are_not_counts_is_booked_at_the_bound(tmp_path, tokens):
    """No cost reported: the booking falls back to tokens x prices, which a negative count would make negative."""
    with _Provider({"prompt_tokens": 3, "completion_tokens": tokens}) as server:
        stats = regenerate_dataset_sync(
            _convs(3), tmp_path / "raw.jsonl", _backend(server.url), _settings(concurrency=1), dataset="ds"
        )
    assert stats.num_successes == 3 and stats.num_replies_usage_malformed == 3
    assert stats.cost_usd == pytest.approx(3 * BILLED_USD) and stats.completion_tokens == 0


class _Provider(LoopbackHTTPServer):
    """Answers every request with `usage` as given (and no choices when `unusable`)."""

    def __init__(self, usage: dict, *, unusable: bool = False) -> None:
        self.usage, self.unusable, self.num_served = usage, unusable, 0
        super().__init__()

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                choices = (
                    []
                    if fake.unusable
                    else [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]
                )
                payload = json.dumps({"id": "x", "choices": choices, "usage": fake.usage}).encode()
                fake.num_served += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        return Handler


@pytest.mark.parametrize("cost", BAD_COSTS, ids=BAD_IDS)
def test_a_paid_unusable_reply_with_a_bad_cost_is_booked_at_its_bound_in_this_run_and_the_next(tmp_path, cost):
    store = tmp_path / "raw.jsonl"
    with _Provider({"completion_tokens": 1, "cost": cost}, unusable=True) as server:
        stats = regenerate_dataset_sync(
            _convs(3), store, _backend(server.url), _settings(concurrency=1, max_failure_fraction=1.0), dataset="ds"
        )
    assert server.num_served == 3 and stats.failures_by_kind == {"unusable_reply": 3}
    assert stats.num_replies_usage_malformed == 3 and stats.cost_usd == pytest.approx(3 * BILLED_USD)
    with ResponseStore(store) as log:
        assert log.recorded_cost_usd == pytest.approx(3 * BILLED_USD)
    assert not math.isnan(stats.recorded_cost_usd)


def test_a_log_that_recorded_a_malformed_cost_counts_the_request_at_its_bound_when_read_back(tmp_path, caplog):
    """Logs written before the check: NaN and infinity were written as null, a negative cost as it was."""
    store = tmp_path / "raw.jsonl"
    lines = [
        {"type": "sent", "request_id": "a", "bound_usd": 0.01},
        {"type": "turn", "request_id": "a", "cost_usd": None},
        {"type": "sent", "request_id": "b", "bound_usd": 0.01},
        {"type": "failed", "request_id": "b", "kind": "unusable_reply", "cost_usd": -0.5},
        {"type": "sent", "request_id": "c", "bound_usd": 0.01},
        {"type": "turn", "request_id": "c", "cost_usd": 0.002},
        {"type": "sent", "request_id": "d", "bound_usd": 0.01},
        {"type": "failed", "request_id": "d", "kind": "server_error"},
    ]
    store.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with caplog.at_level(logging.WARNING, logger="eagle3_dagster.generate"), ResponseStore(store) as log:
        assert log.recorded_cost_usd == pytest.approx(0.01 + 0.01 + 0.002)
    assert "request a" in caplog.text and "request b" in caplog.text and "request c" not in caplog.text
