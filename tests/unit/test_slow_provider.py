"""Money against a provider slower than `generation.timeout_s`: a real HTTP server on loopback that bills every
request it finishes, whether or not the client still waits for the answer (what a non-streaming provider
does). What it billed is compared with what the request log records, in the run and across reruns and a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import orjson
import pytest

from eagle3_dagster.contracts import Conversation
from eagle3_dagster.generate import RegenerationFailedError, ResponseStore
from eagle3_dagster.generate.client import OpenAIChatBackend
from eagle3_dagster.generate.regenerate import GenerationSettings, regenerate_dataset_sync
from tests.loopback_http import LoopbackHTTPServer

MODEL = "moonshotai/kimi-k2.5"
COST = 0.01  # what the provider bills per finished request; also each request's bound below
TIMEOUT_S = 0.3


class BillingProvider(LoopbackHTTPServer):
    """`/v1/chat/completions` answering after `delay_s` (the first `slow_first` requests; the rest after
    `fast_delay_s`) and billing `cost` for every request it finishes, even when the client hung up."""

    def __init__(
        self, *, delay_s: float, slow_first: int | None = None, fast_delay_s: float = 0.0, cost: float = COST
    ) -> None:
        self.delay_s, self.slow_first, self.fast_delay_s, self.cost = delay_s, slow_first, fast_delay_s, cost
        self.lock = threading.Lock()
        self.arrived = 0
        self.in_handler = 0
        self.billed_usd = 0.0
        self.num_billed = 0
        super().__init__()

    def settle(self, timeout_s: float = 30.0) -> None:
        """Wait until every request that arrived is finished (and billed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if self.in_handler == 0:
                    return
            time.sleep(0.02)
        raise AssertionError("the provider did not finish its requests")

    def _handler(self):
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self) -> None:
                with provider.lock:
                    provider.in_handler += 1
                    provider.arrived += 1
                    slow = provider.slow_first is None or provider.arrived <= provider.slow_first
                try:
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    time.sleep(provider.delay_s if slow else provider.fast_delay_s)
                    with provider.lock:  # finished: billed, whoever still listens
                        provider.billed_usd += provider.cost
                        provider.num_billed += 1
                    payload = json.dumps(
                        {
                            "model": body["model"],
                            "provider": "Stub",
                            "choices": [
                                {
                                    "index": 0,
                                    "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": "ok", "reasoning": "r"},
                                }
                            ],
                            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "cost": provider.cost},
                        }
                    ).encode()
                    try:
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Content-Length", str(len(payload)))
                        self.end_headers()
                        self.wfile.write(payload)
                    except OSError:
                        pass  # the client gave up waiting; the request is billed all the same
                finally:
                    with provider.lock:
                        provider.in_handler -= 1

        return Handler


def _convs(n: int) -> list[Conversation]:
    return [
        Conversation(id=f"c{i}", messages=({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": ""}))
        for i in range(n)
    ]


def _settings(**kw) -> GenerationSettings:
    # the bound of one request: 32 tokens x $0.0003125 = $0.01 = what the provider bills
    kw = {
        "model": MODEL,
        "max_new_tokens": 32,
        "concurrency": 4,
        "budget_usd": 0.10,
        "price_per_completion_token": COST / 32,
        "max_failure_fraction": 1.0,
        **kw,
    }
    return GenerationSettings(**kw)


def _backend(provider: BillingProvider, **kw) -> OpenAIChatBackend:
    kw = {"timeout_s": TIMEOUT_S, "max_retries": 3, "backoff_initial_s": 0.01, "backoff_max_s": 0.02, **kw}
    return OpenAIChatBackend(provider.url, MODEL, "sk-test", **kw)


def _recorded(store: Path) -> float:
    with ResponseStore(store) as log:
        return log.recorded_cost_usd


def test_a_provider_slower_than_the_timeout_never_bills_more_than_the_log_records_nor_the_cap(tmp_path):
    store = tmp_path / "raw.jsonl"
    with BillingProvider(delay_s=TIMEOUT_S * 3) as provider:
        first = regenerate_dataset_sync(_convs(12), store, _backend(provider), _settings(), dataset="ds")
        provider.settle()
        billed_first, recorded_first = provider.billed_usd, _recorded(store)
        again = regenerate_dataset_sync(_convs(12), store, _backend(provider), _settings(), dataset="ds")
        provider.settle()
    assert first.stopped_by_budget
    assert billed_first <= recorded_first + 1e-9 <= 0.10 + 1e-9, (billed_first, recorded_first)
    assert recorded_first == pytest.approx(0.10)  # ten tries fit the cap, each booked at its bound
    # the rerun sends nothing: what timed out may be paid, and the cap is reached
    assert again.num_requests == 0 and provider.billed_usd == pytest.approx(billed_first)
    assert _recorded(store) == pytest.approx(recorded_first)


def test_a_timed_out_request_is_not_sent_again_by_a_rerun_unless_the_setting_allows_it(tmp_path):
    store = tmp_path / "raw.jsonl"
    with BillingProvider(delay_s=TIMEOUT_S * 3) as provider:
        with pytest.raises(RegenerationFailedError, match="generation.resend_interrupted") as err:
            regenerate_dataset_sync(
                _convs(2),
                store,
                _backend(provider, max_retries=0),
                _settings(budget_usd=None, max_failure_fraction=0.0),
                dataset="ds",
            )
        assert err.value.stats.failures_by_kind == {"timeout": 2}
        provider.settle()
        assert provider.num_billed == 2 and _recorded(store) == pytest.approx(0.02)
        again = regenerate_dataset_sync(_convs(2), store, _backend(provider), _settings(budget_usd=None), dataset="ds")
        assert again.num_requests == 0 and again.num_requests_held_back_maybe_paid == 2
        provider.delay_s = 0.0
        resent = regenerate_dataset_sync(
            _convs(2), store, _backend(provider), _settings(budget_usd=None, resend_interrupted=True), dataset="ds"
        )
        provider.settle()
    assert resent.num_successes == 2 and provider.num_billed == 4
    assert _recorded(store) == pytest.approx(provider.billed_usd)


def test_a_timeout_then_a_success_books_both_tries_and_the_retry_reserves_again(tmp_path):
    store = tmp_path / "raw.jsonl"
    with BillingProvider(delay_s=TIMEOUT_S * 3, slow_first=4, fast_delay_s=0.0) as provider:
        stats = regenerate_dataset_sync(_convs(4), store, _backend(provider), _settings(budget_usd=1.0), dataset="ds")
        provider.settle()
    assert stats.num_successes == 4 and provider.num_billed == 8
    assert provider.billed_usd == pytest.approx(0.08)
    assert _recorded(store) == pytest.approx(provider.billed_usd) and stats.cost_usd == pytest.approx(0.08)


def test_a_retry_after_a_timeout_waits_for_room_under_the_cap(tmp_path):
    store = tmp_path / "raw.jsonl"
    # room for three tries: the first times out, its retry and one more request fit, the fourth does not
    with BillingProvider(delay_s=TIMEOUT_S * 3, slow_first=1, fast_delay_s=0.0) as provider:
        stats = regenerate_dataset_sync(
            _convs(4), store, _backend(provider), _settings(budget_usd=0.03, concurrency=1), dataset="ds"
        )
        provider.settle()
    assert provider.num_billed == 3 and stats.stopped_by_budget
    assert provider.billed_usd <= _recorded(store) + 1e-9 <= 0.03 + 1e-9


_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from eagle3_dagster.contracts import Conversation
    from eagle3_dagster.generate.client import OpenAIChatBackend
    from eagle3_dagster.generate.regenerate import GenerationSettings, regenerate_dataset_sync
    url, store = sys.argv[1:]
    convs = [Conversation(id=f"c{i}", messages=({"role": "user", "content": f"q{i}"},
                                                 {"role": "assistant", "content": ""})) for i in range(8)]
    settings = GenerationSettings(model="m", max_new_tokens=32, concurrency=4, budget_usd=1.0,
                                  price_per_completion_token=0.01 / 32)
    regenerate_dataset_sync(convs, Path(store), OpenAIChatBackend(url, "m", "sk-child", timeout_s=60), settings,
                            dataset="ds")
""")


def test_requests_in_flight_when_the_run_is_killed_stay_booked_at_their_bound(tmp_path):
    store = tmp_path / "raw.jsonl"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with BillingProvider(delay_s=30.0) as provider:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, provider.url, str(store)], env=env, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 60
        while provider.arrived < 4 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.02)
        assert provider.arrived == 4, child.stderr.read().decode()[-2000:] if child.poll() is not None else ""
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stderr.close()
        sent = [r for r in map(orjson.loads, store.read_bytes().splitlines()) if r["type"] == "sent"]
        assert len(sent) == 4
        # four requests reached the provider and will be billed: the log books them at their bound
        assert _recorded(store) == pytest.approx(4 * 0.01)
