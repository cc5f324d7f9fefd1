"""The OpenAI-compatible client against a real HTTP server on loopback serving OpenRouter-shaped replies."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from eagle3_dagster.generate.client import ChatRequestError, OpenAIChatBackend, parse_chat_response
from tests.loopback_http import LoopbackHTTPServer

SECRET = "sk-or-v1-SECRETSECRETSECRET"


class FakeOpenRouter(LoopbackHTTPServer):
    """A loopback `/v1/chat/completions`. `faults` are consumed one per arriving request, in order:
    "429" (Retry-After: 0), "500", "timeout" (sleeps past the client timeout), "garbage" (not JSON),
    "nochoices", "truncated" (a 200 whose JSON body is cut off), "echo_key" (a 400 whose body echoes the
    Authorization header). `report_usage=False` leaves `usage` out of every answer.
    Requests after the `block_after`-th block until `release` is set (to kill a client mid-flight)."""

    def __init__(
        self,
        faults: list[str] | None = None,
        *,
        delay_s: float = 0.0,
        cost: float = 0.001,
        block_after: int | None = None,
        timeout_sleep_s: float = 1.0,
        report_usage: bool = True,
    ) -> None:
        self.faults = list(faults or [])
        self.delay_s, self.cost, self.block_after, self.timeout_sleep_s = delay_s, cost, block_after, timeout_sleep_s
        self.report_usage = report_usage
        self.in_flight = self.max_in_flight = 0
        self.received: list[str] = []  # X-Request-Id of every arriving request (each attempt)
        self.served: list[str] = []  # ids answered with a 200 and a valid completion
        self.bodies: list[dict] = []
        self.blocked: list[str] = []
        self.release = threading.Event()
        self.lock = threading.Lock()
        super().__init__()

    def __exit__(self, *exc: object) -> None:
        self.release.set()  # handlers held back by the test return before the server stops
        super().__exit__(*exc)

    @staticmethod
    def answer(body: dict) -> dict:
        last_user = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
        n_assistant = sum(m["role"] == "assistant" for m in body["messages"])
        message = {
            "role": "assistant",
            "content": f"answer {n_assistant} to {last_user}",
            "reasoning": f"thinking about {last_user}",
        }
        finish = "stop"
        if "weather" in last_user:
            message["tool_calls"] = [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ]
            finish = "tool_calls"
        return message, finish

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _send(self, status: int, payload: bytes, headers: dict | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_POST(self) -> None:
                with fake.lock:
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    self._post()
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

            def _post(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                rid = self.headers.get("X-Request-Id", "")
                with fake.lock:
                    fake.received.append(rid)
                    fake.bodies.append(body)
                    fault = fake.faults.pop(0) if fake.faults else None
                    block = fake.block_after is not None and len(fake.served) >= fake.block_after
                    if block:
                        fake.blocked.append(rid)
                if block:
                    fake.release.wait(30)
                    return
                time.sleep(fake.delay_s)
                if fault == "429":
                    return self._send(429, b'{"error":{"message":"rate limited"}}', {"Retry-After": "0"})
                if fault == "500":
                    return self._send(500, b'{"error":{"message":"upstream error"}}')
                if fault == "timeout":
                    time.sleep(fake.timeout_sleep_s)
                    return self._send(200, b"{}")
                if fault == "garbage":
                    return self._send(200, b"<html>not json")
                if fault == "nochoices":
                    return self._send(200, b'{"id": "x", "choices": []}')
                if fault == "truncated":
                    return self._send(200, b'{"id": "x", "choices": [{"index": 0, "message": {"role": "assi')
                if fault == "echo_key":
                    return self._send(400, json.dumps({"error": self.headers.get("Authorization")}).encode())
                message, finish = fake.answer(body)
                payload = {
                    "id": f"gen-{rid}",
                    "object": "chat.completion",
                    "model": body["model"],
                    "provider": "Moonshot AI",
                    "choices": [
                        {"index": 0, "finish_reason": finish, "native_finish_reason": finish, "message": message}
                    ],
                    "usage": {
                        "prompt_tokens": 11,
                        "completion_tokens": 7,
                        "total_tokens": 18,
                        "completion_tokens_details": {"reasoning_tokens": 3},
                        "cost": fake.cost,
                    },
                }
                if not fake.report_usage:
                    del payload["usage"]
                with fake.lock:
                    fake.served.append(rid)
                self._send(200, json.dumps(payload).encode())

        return Handler


def _backend(server: FakeOpenRouter, **kw) -> OpenAIChatBackend:
    kw.setdefault("timeout_s", 0.4)
    kw.setdefault("backoff_initial_s", 0.01)
    kw.setdefault("backoff_max_s", 0.05)
    return OpenAIChatBackend(server.url, "moonshotai/kimi-k2.5", SECRET, **kw)


def _complete(backend: OpenAIChatBackend, content: str = "hi", rid: str = "r1"):
    async def go():
        try:
            return await backend.complete(
                [{"role": "user", "content": content}], request_id=rid, max_tokens=16, temperature=0.0, reasoning=True
            )
        finally:
            await backend.aclose()

    return asyncio.run(go())


def test_response_keeps_reasoning_tool_calls_usage_cost_and_provider():
    with FakeOpenRouter() as server:
        result = _complete(_backend(server), "what is the weather in Paris")
    assert result.reasoning == "thinking about what is the weather in Paris"
    assert result.content == "answer 0 to what is the weather in Paris"
    assert result.tool_calls == [
        {
            "id": "functions.get_weather:0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        }
    ]
    assert result.finish_reason == "tool_calls"
    assert result.usage == {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18, "reasoning_tokens": 3}
    assert result.cost == 0.001 and result.provider == "Moonshot AI"
    assert server.bodies[0]["reasoning"] == {"enabled": True} and server.bodies[0]["max_tokens"] == 16


def test_reasoning_content_field_of_sglang_and_vllm_is_read_too():
    body = {"choices": [{"finish_reason": "stop", "message": {"content": "x", "reasoning_content": "why"}}]}
    result = parse_chat_response(body)
    assert result.reasoning == "why" and result.cost is None and result.tool_calls == []


def test_429_500_and_timeout_are_retried_and_each_counted_by_kind():
    with FakeOpenRouter(["429", "500", "timeout"]) as server:
        result = _complete(_backend(server, max_retries=6))
    assert result.content == "answer 0 to hi"
    assert result.attempt_failures == {"rate_limited": 1, "server_error": 1, "timeout": 1}
    assert server.received == ["r1"] * 4


@pytest.mark.parametrize("fault", ["garbage", "nochoices", "truncated"])
def test_a_200_whose_answer_is_unusable_is_paid_and_not_retried_behind_the_budget(fault):
    with FakeOpenRouter([fault]) as server:
        with pytest.raises(ChatRequestError) as err:
            _complete(_backend(server, max_retries=6))
    assert err.value.kind == "unusable_reply" and err.value.paid
    assert server.received == ["r1"]


def test_retries_give_up_after_max_retries_with_the_last_kind():
    with FakeOpenRouter(["500"] * 5) as server:
        with pytest.raises(ChatRequestError) as err:
            _complete(_backend(server, max_retries=2))
    assert err.value.kind == "server_error"
    assert err.value.attempt_failures == {"server_error": 3}
    assert len(server.received) == 3


def test_retry_after_header_is_honoured():
    with FakeOpenRouter(["429"]) as server:
        backend = _backend(server, backoff_initial_s=5.0, backoff_max_s=5.0)
        waits: list[float] = []
        policy = backend._wait  # record each wait the retry policy chooses, without timing anything
        backend._wait = lambda state: waits.append(policy(state)) or waits[-1]
        result = _complete(backend)
    # exponential backoff would wait 5 s; Retry-After: 0 means retry at once
    assert waits == [0.0]
    assert result.attempt_failures == {"rate_limited": 1}


def test_client_errors_are_not_retried_and_the_api_key_never_appears_in_the_error():
    backend = None
    with FakeOpenRouter(["echo_key"]) as server:
        backend = _backend(server)
        with pytest.raises(ChatRequestError) as err:
            _complete(backend)
    assert err.value.kind == "client_error"
    assert len(server.received) == 1
    assert SECRET not in str(err.value) and SECRET not in repr(err.value)
    assert SECRET not in repr(backend)
    assert "***" in str(err.value)
