"""One chat interface for every backend, and its OpenAI-compatible HTTP implementation.

Owns: the `ChatBackend` protocol (messages in, one `ChatResult` out), the request
shape sent to OpenRouter / SGLang / vLLM `/v1/chat/completions`, parsing their
responses (reasoning, tool calls, usage, cost, provider), and retries with
backoff. What to ask and what to record is `regenerate.py`'s job.

Retry policy: 429 (honouring `Retry-After`), 5xx, timeouts and connection errors
are retried with exponential jitter; other 4xx are not (they will fail the same
way again). An HTTP 200 whose body is truncated, not JSON or has no choices is
an `unusable_reply`: the provider was paid for it, so it is not retried here but
raised with `paid=True` (and the cost the body reported, if any) for the
regenerator to book as spent. Every failed attempt is counted by kind on the
result or on the final `ChatRequestError`.

`usage` is the provider's word on what it billed, and is checked where it is
parsed (`parse_usage`): a cost that is not a finite number >= 0 (negative, NaN,
infinite, a string, a boolean) or a token count that is not an integer >= 0 is
left out of the result and named in `usage_problems` (the field, and the value
when it is a number), for the regenerator to book the reply at its bound and count it.

A try that may have reached the provider and lost its answer (a read or write
timeout, a connection dropped after the request went out) is `maybe_paid`: a
non-streaming provider bills a request when it finishes it, whether or not the
client still waits. Before such a try is retried, `complete()` awaits the
caller's `before_resend` hook, which books the lost try and reserves for the
next one (or returns False when the budget has no room: the retries stop). A
timeout while connecting, or a refused connection, never reached the provider.

The API key is a constructor value, checked by `clean_api_key` (surrounding
whitespace stripped: a key pasted with its newline is common; anything else that
is whitespace or a control character is refused, without showing the key). It is
only ever placed in the Authorization header: never in reprs, log lines,
exception text or results (messages built from a server's reply are scrubbed of
it in every form a reply or a library prints it: raw, escaped, repr, JSON).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from eagle3_dagster.generate.budget import token_count, usd_amount

log = logging.getLogger(__name__)

_RETRY_AFTER_CAP_S = 600.0  # a server asking for longer than this is treated as down
RETRYABLE_KINDS = frozenset({"rate_limited", "server_error", "timeout", "connection"})
# Failures raised before the request can have left the process: nothing reached the provider.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)

ResendHook = Callable[[], Awaitable[bool]]


@dataclass(frozen=True)
class ChatResult:
    """One assistant turn as the target produced it."""

    reasoning: str
    content: str
    tool_calls: list[dict]  # OpenAI shape: {"id", "type": "function", "function": {"name", "arguments": str}}
    finish_reason: str | None
    usage: dict  # prompt_tokens, completion_tokens, reasoning_tokens (when reported as counts)
    cost: float | None  # USD as the backend reported it (`usage.cost`); None when it did not, or not as an amount
    provider: str | None
    model: str | None
    attempt_failures: dict[str, int] = field(default_factory=dict)
    num_maybe_paid: int = 0  # earlier tries of this request that may have been billed without an answer
    # The completion's token ids exactly as generated, when the backend knows them (the in-process one):
    # re-tokenizing the decoded text can merge or split differently from what the model produced.
    completion_ids: list[int] | None = None
    # What of the reported usage could not be booked (`parse_usage`): each names its field and value.
    usage_problems: tuple[str, ...] = ()


def clean_api_key(raw: str | None, source: str = "the API key") -> str | None:
    """The key without surrounding whitespace; a ValueError (which never contains the key) when what is
    left holds whitespace or a control character, which no HTTP header may carry."""
    if raw is None:
        return None
    key = raw.strip()
    bad = [i for i, ch in enumerate(key) if ch.isspace() or not ch.isprintable() or not ch.isascii()]
    if bad:
        raise ValueError(
            f"{source}: the API key has a whitespace or control character (or a non-ASCII one) at "
            f"position {bad[0]} of {len(key)} after stripping; the key is not shown. Set the "
            f"variable to the key alone"
        )
    return key or None


def secret_forms(secret: str) -> list[str]:
    """The ways a secret appears when printed: raw, escaped (bytes repr, as h11 prints headers), repr, JSON."""
    import json as _json

    forms = {
        secret,
        repr(secret)[1:-1],
        _json.dumps(secret)[1:-1],
        str(secret.encode())[2:-1],
        secret.encode("unicode_escape").decode(),
    }
    return sorted((f for f in forms if f), key=len, reverse=True)


class ChatRequestError(Exception):
    """A request that failed for good; `kind` is the failure class, `attempt_failures` every failed try."""

    def __init__(
        self,
        kind: str,
        message: str,
        attempt_failures: dict[str, int] | None = None,
        retry_after_s: float | None = None,
        *,
        paid: bool = False,
        cost: float | None = None,
        usage: dict | None = None,
        maybe_paid: bool = False,
        num_maybe_paid: int = 0,
        usage_problems: tuple[str, ...] = (),
    ) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.attempt_failures = dict(attempt_failures or {})
        self.retry_after_s = retry_after_s
        self.paid = paid  # the server answered (HTTP 200) and charged for it, but the answer is unusable
        self.cost = cost  # what that answer cost, when the body said so
        self.usage = dict(usage or {})
        self.maybe_paid = maybe_paid  # this try may have reached the provider, which bills it unanswered
        self.num_maybe_paid = num_maybe_paid  # tries of the request like that, this one included
        self.usage_problems = tuple(usage_problems)  # what of that answer's usage could not be booked


class ChatBackend(Protocol):
    """What the regenerator needs from a backend; `paid` says whether a lost answer cost money.
    `before_resend` is awaited before a try that may have been billed is retried (False: do not retry)."""

    paid: bool

    async def complete(
        self,
        messages: list[dict],
        *,
        request_id: str,
        max_tokens: int,
        temperature: float,
        reasoning: bool,
        before_resend: ResendHook | None = None,
    ) -> ChatResult: ...

    async def aclose(self) -> None: ...


def parse_chat_response(body: Any) -> ChatResult:
    """Parse an OpenAI/OpenRouter/SGLang/vLLM chat completion; a missing piece is a `malformed` error."""
    if not isinstance(body, dict):
        raise ChatRequestError("malformed", "response body is not a JSON object")
    if body.get("error") and not body.get("choices"):
        err = body["error"]
        raise ChatRequestError(
            "server_error", f"error in body: {str(err.get('message', err) if isinstance(err, dict) else err)[:200]}"
        )
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ChatRequestError("malformed", "response has no choices[0]")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise ChatRequestError("malformed", "choices[0].message is missing")
    # OpenRouter says `reasoning`; SGLang/vLLM reasoning parsers say `reasoning_content`.
    reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
    content = message.get("content") or ""
    if not isinstance(reasoning, str) or not isinstance(content, str):
        raise ChatRequestError("malformed", "message.content/reasoning is not a string")
    tool_calls = []
    for i, tc in enumerate(message.get("tool_calls") or []):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatRequestError("malformed", f"tool_calls[{i}] has no function.name")
        args = fn.get("arguments", "")
        tool_calls.append(
            {
                "id": tc.get("id") or f"functions.{fn['name']}:{i}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    usage_in = body.get("usage") or {}
    if not isinstance(usage_in, dict):
        raise ChatRequestError("malformed", "usage is not an object")
    usage, cost, problems = parse_usage(usage_in)
    return ChatResult(
        reasoning=reasoning,
        content=content,
        tool_calls=tool_calls,
        finish_reason=choice.get("finish_reason"),
        usage=usage,
        cost=cost,
        provider=body.get("provider"),
        model=body.get("model"),
        usage_problems=problems,
    )


def parse_usage(usage_in: dict) -> tuple[dict, float | None, tuple[str, ...]]:
    """(token counts, cost in USD, problems) of a reply's `usage`: only values that can be booked are kept;
    each one that cannot (present, not null, and not a count or an amount) is named in `problems`."""
    usage: dict = {}
    problems: list[str] = []
    details = usage_in.get("completion_tokens_details")
    fields = [(k, k, usage_in.get(k)) for k in ("prompt_tokens", "completion_tokens", "total_tokens")]
    if isinstance(details, dict):
        fields.append(
            ("reasoning_tokens", "completion_tokens_details.reasoning_tokens", details.get("reasoning_tokens"))
        )
    for key, name, value in fields:
        if value is None:
            continue
        if (count := token_count(value)) is None:
            problems.append(f"{_shown(name, value)} is not a token count (an integer >= 0)")
        else:
            usage[key] = count
    cost = usage_in.get("cost")
    amount = usd_amount(cost)
    if cost is not None and amount is None:
        problems.append(f"{_shown('cost', cost)} is not a USD amount (a finite number >= 0)")
    return usage, amount, tuple(problems)


def _shown(name: str, value: Any) -> str:
    """A usage field and its value for a log line: a number as it came, anything else by its type only (a string
    or an object may hold anything, the API key included, and a cut-off copy would escape the scrubbing)."""
    if isinstance(value, (int, float)):
        return f"usage.{name}={value!r}"
    kinds: dict[type, str] = {str: "string", dict: "object", list: "array"}
    kind = kinds.get(type(value), type(value).__name__)
    return f"usage.{name} (a JSON {kind}, not shown)"


def _without_credentials(url: str) -> str:
    """`url` without what may be a credential: the user:password@ before the host, the query, the fragment."""
    scheme, _, rest = url.partition("://")
    rest = rest.rpartition("@")[2]  # also when the password holds an unescaped '/'
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    return f"{scheme}://{rest[:cut]}" + ("?***" if cut < len(rest) else "")


def _retry_after_s(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # HTTP-date form: fall back to exponential backoff


class _BackoffOrRetryAfter:
    """Exponential jitter, unless the server said how long to wait (429 `Retry-After`)."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self._exp = wait_exponential_jitter(initial=initial_s, max=max_s)

    def __call__(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, ChatRequestError) and exc.retry_after_s is not None:
            return min(exc.retry_after_s, _RETRY_AFTER_CAP_S)
        return self._exp(state)


class OpenAIChatBackend:
    """OpenRouter, or an SGLang/vLLM server, over `/v1/chat/completions`."""

    paid = True

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 120.0,
        max_retries: int = 6,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 60.0,
        extra_body: dict | None = None,
        reasoning_style: str = "openrouter",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_retries = max_retries
        self.extra_body = dict(extra_body or {})
        self.reasoning_style = reasoning_style  # "openrouter": reasoning={...}; "chat_template": thinking kwarg
        api_key = clean_api_key(api_key)
        self._api_key = api_key
        self._secret_forms = secret_forms(api_key) if api_key else []
        self._wait = _BackoffOrRetryAfter(backoff_initial_s, backoff_max_s)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def __repr__(self) -> str:  # the profile refuses credentials in base_url; a URL built in code may hold some
        return (
            f"OpenAIChatBackend(base_url={_without_credentials(self.base_url)!r}, model={self.model!r}, "
            f"api_key={'***' if self._api_key else None})"
        )

    def _scrub(self, text: str) -> str:
        for form in self._secret_forms:
            text = text.replace(form, "***")
        return text

    def _payload(self, messages: list[dict], max_tokens: int, temperature: float, reasoning: bool) -> dict:
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "usage": {"include": True},
        }
        if self.reasoning_style == "openrouter":
            payload["reasoning"] = {"enabled": reasoning}
        else:  # SGLang/vLLM: Kimi's template kwarg is `thinking`, not `enable_thinking`
            payload["chat_template_kwargs"] = {"thinking": reasoning}
        payload.update(self.extra_body)
        return payload

    async def _attempt(self, payload: dict, request_id: str) -> ChatResult:
        try:
            response = await self._client.post("/chat/completions", json=payload, headers={"X-Request-Id": request_id})
        except httpx.TimeoutException as e:
            raise ChatRequestError("timeout", type(e).__name__, maybe_paid=not isinstance(e, _NOT_SENT)) from None
        except httpx.TransportError as e:
            raise ChatRequestError(
                "connection", self._scrub(f"{type(e).__name__}: {e}"), maybe_paid=not isinstance(e, _NOT_SENT)
            ) from None
        status = response.status_code
        if status == 429:
            raise ChatRequestError("rate_limited", "HTTP 429", retry_after_s=_retry_after_s(response))
        if status >= 500:
            raise ChatRequestError("server_error", f"HTTP {status}: {self._scrub(response.text[:200])}")
        if status >= 400:
            raise ChatRequestError("client_error", f"HTTP {status}: {self._scrub(response.text[:300])}")
        try:
            body = response.json()
        except ValueError:
            raise ChatRequestError(
                "unusable_reply",
                f"HTTP {status} body is not JSON (truncated?): {self._scrub(response.text[:80])!r}",
                paid=True,
            ) from None
        try:
            result = parse_chat_response(body)
        except ChatRequestError as e:
            detail = self._scrub(str(e).split(": ", 1)[-1])
            if e.kind != "malformed":
                raise ChatRequestError(e.kind, detail) from None
            usage_in = body["usage"] if isinstance(body, dict) and isinstance(body.get("usage"), dict) else {}
            usage, cost, problems = parse_usage(usage_in)
            raise ChatRequestError(
                "unusable_reply",
                f"HTTP {status} answer unusable: {detail}",
                paid=True,
                cost=cost,
                usage=usage,
                usage_problems=tuple(self._scrub(p) for p in problems),
            ) from None
        if result.usage_problems:  # they quote the reply's values, which may echo the key
            result = replace(result, usage_problems=tuple(self._scrub(p) for p in result.usage_problems))
        return result

    async def complete(
        self,
        messages: list[dict],
        *,
        request_id: str,
        max_tokens: int,
        temperature: float,
        reasoning: bool,
        before_resend: ResendHook | None = None,
    ) -> ChatResult:
        payload = self._payload(messages, max_tokens, temperature, reasoning)
        failures: Counter[str] = Counter()
        num_maybe_paid = 0
        no_room = False  # the budget had no room to resend a try that may have been billed

        def retryable(e: BaseException) -> bool:
            return isinstance(e, ChatRequestError) and e.kind in RETRYABLE_KINDS and not no_room

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1),
            wait=self._wait,
            retry=retry_if_exception(retryable),
            reraise=True,
        )
        last: ChatRequestError | None = None
        try:
            async for attempt in retrying:
                with attempt:
                    if last is not None and last.maybe_paid and before_resend is not None and not await before_resend():
                        no_room = True
                        raise last
                    try:
                        result = await self._attempt(payload, request_id)
                    except ChatRequestError as e:
                        failures[e.kind] += 1
                        num_maybe_paid += e.maybe_paid
                        last = e
                        log.info("request %s attempt %d failed: %s", request_id, attempt.retry_state.attempt_number, e)
                        raise
        except ChatRequestError as e:
            raise ChatRequestError(
                e.kind,
                str(e).split(": ", 1)[-1],
                dict(failures),
                paid=e.paid,
                cost=e.cost,
                usage=e.usage,
                maybe_paid=e.maybe_paid,
                num_maybe_paid=num_maybe_paid,
                usage_problems=e.usage_problems,
            ) from None
        return ChatResult(**{**result.__dict__, "attempt_failures": dict(failures), "num_maybe_paid": num_maybe_paid})

    async def aclose(self) -> None:
        await self._client.aclose()
