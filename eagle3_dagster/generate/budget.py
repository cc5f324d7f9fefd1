"""The USD cap of a `raw_responses` partition: reserve a request's worst case before it is sent, settle after.

Owns: the worst-case cost of one request (`max_new_tokens` x the completion price,
plus the prompt's bound x the prompt price), what a finished request is booked
at, and the ledger of money reserved by requests in flight. The regenerator asks
`reserve()` before every send and calls `settle()` when the request ends, paid or
not; what it records in the log is `recorded_usd`'s source of truth on restart.

Why reserve rather than check: with N requests in flight, checking the spent sum
before each send lets N requests pass a cap that only one more fits (concurrency
16 spent ten times a $0.015 budget). A reservation is taken under the same lock
as the check, so at any concurrency the spent plus reserved sum stays within the
cap. A request that does not fit waits while others are in flight (their
settlement may free room) and stops the run only when nothing is in flight.

What a request is booked at: `usage.cost` when the provider reported it; else its
reported token counts at the configured prices; else (no usage at all, or a paid
reply whose body was unusable) the reserved bound. A reply whose usage is malformed
(a cost or token count that is not a finite number >= 0: negative, NaN, infinite,
a string) is booked at the bound too: the provider's word on what it billed is
foreign input, and a negative or NaN amount booked as spent would free room under
the cap (and NaN is written to the log as null, read back as $0 by the next run). A request the provider refused
(HTTP 429/5xx, a connection that never opened) is booked at zero. A try that may
have reached the provider and lost its answer (a timeout: a non-streaming
provider bills what it finishes, whether the client still waits or not) stays
booked at its bound, and its retry reserves again, so the cap covers both.
"""

from __future__ import annotations

import asyncio
import logging
import math

import orjson

log = logging.getLogger(__name__)

_EPS_USD = 1e-9  # float residue of summed prices: ten $0.01 bounds fit a $0.10 cap


def usd_amount(value: object) -> float | None:
    """`value` as a USD amount when it is one (a JSON number, finite and >= 0), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


def token_count(value: object) -> int | None:
    """`value` as a token count when it is one (a JSON integer >= 0, or a float with an integer value), else None."""
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def prompt_token_bound(messages: list[dict]) -> int:
    """At least the prompt's token count: its JSON's UTF-8 bytes. A byte-level BPE token (Kimi, DeepSeek,
    GPT-style tokenizers) covers at least one byte, and the JSON framing of each message is longer than
    the chat template's role markers."""
    return len(orjson.dumps(messages))


class Budget:
    """Reservations against `cap_usd` (None: no cap, still books what was spent)."""

    def __init__(
        self,
        cap_usd: float | None,
        already_spent_usd: float,
        *,
        max_new_tokens: int,
        price_per_completion_token: float | None,
        price_per_prompt_token: float = 0.0,
    ) -> None:
        if cap_usd is not None and price_per_completion_token is None:
            raise ValueError(
                "a budget needs price_per_completion_token (generation.price_usd_per_completion_token): "
                "each request reserves max_new_tokens x this price before it is sent"
            )
        self.cap_usd = cap_usd
        self.spent_usd = already_spent_usd
        self.reserved_usd = 0.0
        self.num_in_flight = 0  # counted, not inferred from reserved_usd (float residue is never exactly 0)
        self.max_new_tokens = max_new_tokens
        self.price_completion = price_per_completion_token or 0.0
        self.price_prompt = price_per_prompt_token
        self.exhausted = False
        self._changed = asyncio.Condition()

    def bound(self, messages: list[dict]) -> float:
        return self.max_new_tokens * self.price_completion + prompt_token_bound(messages) * self.price_prompt

    async def reserve(self, messages: list[dict]) -> float | None:
        """The amount reserved for this request, or None once the cap is reached (the run should stop)."""
        bound = self.bound(messages)
        async with self._changed:
            while True:
                if self.exhausted:
                    return None
                if self.cap_usd is None or self.spent_usd + self.reserved_usd + bound <= self.cap_usd + _EPS_USD:
                    self.reserved_usd += bound
                    self.num_in_flight += 1
                    return bound
                if self.num_in_flight == 0:
                    log.warning("budget of $%.4f reached ($%.4f spent); no new requests", self.cap_usd, self.spent_usd)
                    self.exhausted = True
                    self._changed.notify_all()
                    return None
                await self._changed.wait()  # a request in flight may settle below its bound

    def booked(
        self, reserved: float, *, cost: float | None, usage: dict | None, paid: bool, malformed: bool = False
    ) -> float:
        """What a finished request cost: reported cost, else reported tokens at the prices, else the bound.
        `malformed` (the reply's usage had a value that is not an amount or a count): the bound; so is a
        cost or a token count here that is not one (the client drops them; this is the last line)."""
        if not paid:
            return 0.0
        if malformed:
            return reserved
        if cost is not None:
            amount = usd_amount(cost)
            return reserved if amount is None else amount
        usage = usage or {}
        completion = token_count(usage.get("completion_tokens"))
        prompt = token_count(usage.get("prompt_tokens") or 0)
        if completion is not None and prompt is not None and self.price_completion:
            return completion * self.price_completion + prompt * self.price_prompt
        return reserved

    async def settle(self, reserved: float, spent: float) -> None:
        if spent > reserved + 1e-12 and self.cap_usd is not None:
            log.warning(
                "a request cost $%.6f, more than its reserved bound $%.6f: the configured prices are "
                "below the provider's, raise generation.price_usd_per_completion_token",
                spent,
                reserved,
            )
        async with self._changed:
            self.num_in_flight -= 1
            self.reserved_usd = max(0.0, self.reserved_usd - reserved) if self.num_in_flight else 0.0
            self.spent_usd += spent
            self._changed.notify_all()
