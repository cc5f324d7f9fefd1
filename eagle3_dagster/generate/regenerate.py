"""Regenerate a dataset's assistant turns with the target itself, turn by turn, resumably.

Owns: walking each conversation (system and user turns kept, every assistant
turn replaced by the target's answer to the history *with its own earlier
answers*), the deterministic request ids, bounded concurrency (conversations in
parallel, turns of one conversation in order), the USD budget, and the stats of
a `raw_responses` partition. HTTP lives in `client.py`, the log in `store.py`,
the reservations against the budget in `budget.py`.

Never paying twice: a request id is recorded as `sent` (with its bound) before it
leaves and as a `turn` when its answer is back. On restart a recorded turn is
reused, and a request that may be paid while its answer is lost (the process
died while it was in flight, or it timed out after reaching the provider) is
*not* re-sent for a paid backend: its conversation is counted as `interrupted`
and left incomplete, unless `resend_interrupted` says a repeat is acceptable
(the free in-process backend always re-sends). A paid but unusable reply is
booked as spent (a `failed` line with its cost) before anything is sent again.
A reply whose reported usage is malformed (`client.parse_usage`) is booked at its
bound and counted in `num_replies_usage_malformed`.
Within a run, a try that timed out stays booked at its bound and its retry
reserves anew (`before_resend`), so a provider slower than the timeout cannot
bill past the cap.

A run in which more than `max_failure_fraction` of the requests sent failed for
good raises `RegenerationFailedError` naming the failure kinds, after everything
that did come back is recorded.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from eagle3_dagster.contracts import Conversation
from eagle3_dagster.generate.budget import Budget
from eagle3_dagster.generate.client import ChatBackend, ChatRequestError, ChatResult
from eagle3_dagster.generate.store import ResponseStore, producer_key, set_aside_reason
from eagle3_dagster.progress import ProgressMeter, no_progress

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationSettings:
    """What shapes an answer (part of the request id) and how the run behaves (not part of it)."""

    model: str
    max_new_tokens: int = 256
    temperature: float = 0.0
    reasoning: bool = True
    max_turns: int = 8
    concurrency: int = 8
    budget_usd: float | None = None
    price_per_completion_token: float | None = None  # USD, an upper bound: reservations use it
    price_per_prompt_token: float = 0.0
    max_failure_fraction: float = 0.05
    resend_interrupted: bool = False
    progress_every_s: float = 5.0
    # Who answers (`target.answer_producer`): part of the request id, recorded with every turn, so an answer
    # of another target or tokenizer is never reused. None: library use without one (old ids).
    producer: dict | None = None

    def identity(self) -> dict:
        identity = {
            "model": self.model,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "reasoning": self.reasoning,
        }
        if self.producer:
            identity["producer"] = self.producer
        return identity


def request_id(dataset: str, conversation_id: str, turn: int, settings: GenerationSettings) -> str:
    """Same dataset, conversation, turn and generation settings -> same id, in every run."""
    key = orjson.dumps([dataset, conversation_id, turn, settings.identity()], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(key).hexdigest()[:32]


@dataclass
class RegenerationStats:
    dataset: str
    num_conversations: int = 0
    num_conversations_complete: int = 0
    num_conversations_already_complete: int = 0
    num_conversations_interrupted: int = 0
    num_conversations_failed: int = 0
    num_turns: int = 0  # assistant turns recorded for the conversations seen (new + reused)
    num_requests: int = 0  # requests sent in this run
    num_successes: int = 0
    num_turns_reused: int = 0
    num_turns_skipped: int = 0  # assistant turns with no user turn before them
    num_tries_maybe_paid: int = 0  # tries that timed out after reaching the provider: booked at their bound
    num_failed_maybe_paid: int = 0  # requests whose last try was such a timeout: a rerun holds them back
    num_requests_held_back_maybe_paid: int = 0  # not re-sent: may be paid already (generation.resend_interrupted)
    unsettled_usd_at_start: float = 0.0  # bounds of the tries an earlier run left in flight, booked as spent
    num_turns_set_aside: int = 0  # turns on record from another producer (target, model or tokenizer): unused
    set_aside_by_reason: dict[str, int] = field(default_factory=dict)
    failures_by_kind: dict[str, int] = field(default_factory=dict)  # requests that failed for good
    attempt_failures_by_kind: dict[str, int] = field(default_factory=dict)  # every failed try, retried or not
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float = 0.0  # spent in this run
    recorded_cost_usd: float = 0.0  # spent on this partition by all runs so far
    num_paid_unusable: int = 0  # HTTP 200 answers that were paid for but could not be used
    # paid replies whose usage.cost or a token count was not a number >= 0 (negative, NaN, infinite, a string):
    # each booked at its bound, the most the request could have cost, and named in a warning
    num_replies_usage_malformed: int = 0
    stopped_by_budget: bool = False
    repaired_bytes: int = 0
    wall_s: float = 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "requests_per_s": round(self.requests_per_s, 3)}


class RegenerationFailedError(RuntimeError):
    """Too many requests of a run failed for good; `stats` holds the run's counts."""

    def __init__(self, message: str, stats: RegenerationStats) -> None:
        super().__init__(message)
        self.stats = stats


class _Run:
    """State shared by the conversation workers of one `regenerate_dataset` call."""

    def __init__(self, store: ResponseStore, backend: ChatBackend, settings: GenerationSettings, dataset: str) -> None:
        self.store, self.backend, self.settings, self.dataset = store, backend, settings, dataset
        self.stats = RegenerationStats(
            dataset=dataset,
            recorded_cost_usd=store.recorded_cost_usd,
            repaired_bytes=store.repaired_bytes,
            unsettled_usd_at_start=store.unsettled_usd,
        )
        self.failures: Counter[str] = Counter()
        self.attempt_failures: Counter[str] = Counter()
        # a free backend (in-process) costs nothing: no cap, so no price is needed
        cap = settings.budget_usd if backend.paid else None
        self.budget = Budget(
            cap,
            store.recorded_cost_usd,
            max_new_tokens=settings.max_new_tokens,
            price_per_completion_token=settings.price_per_completion_token,
            price_per_prompt_token=settings.price_per_prompt_token,
        )
        self.stop = False
        if settings.producer:
            current = producer_key(settings.producer)
            for key, n in store.turns_by_producer.items():
                if key != current:
                    reason = set_aside_reason(orjson.loads(key) if key else None, settings.producer)
                    self.stats.set_aside_by_reason[reason] = self.stats.set_aside_by_reason.get(reason, 0) + n
                    self.stats.num_turns_set_aside += n
            if self.stats.num_turns_set_aside:
                log.warning(
                    "%s: %d recorded turns are set aside, not reused: %s",
                    dataset,
                    self.stats.num_turns_set_aside,
                    self.stats.set_aside_by_reason,
                )

    async def conversation(self, conv: Conversation) -> None:
        st = self.stats
        st.num_conversations += 1
        if self.store.is_complete(conv.id, self.settings.producer):
            st.num_conversations_already_complete += 1
            st.num_conversations_complete += 1
            return
        history: list[dict] = []
        turn_ids: list[str] = []
        for message in conv.messages:
            if message["role"] != "assistant":
                history.append({"role": message["role"], "content": message["content"]})
                continue
            if len(turn_ids) >= self.settings.max_turns:
                break
            if not history or history[-1]["role"] != "user":
                st.num_turns_skipped += 1
                continue
            rid = request_id(self.dataset, conv.id, len(turn_ids), self.settings)
            record = await self._turn(rid, conv.id, len(turn_ids), history)
            if record is None:
                return
            history.append(_history_message(record["response"]))
            turn_ids.append(rid)
        if turn_ids:
            self.store.mark_complete(conv.id, turn_ids, self.settings.producer)
            st.num_conversations_complete += 1

    async def _turn(self, rid: str, conv_id: str, turn: int, history: list[dict]) -> dict | None:
        st, store = self.stats, self.store
        if store.has_turn(rid):
            st.num_turns += 1
            st.num_turns_reused += 1
            return store.get_turn(rid)
        lost = (
            "was in flight when an earlier run died"
            if store.is_interrupted(rid)
            else "timed out after reaching the provider"
            if store.is_maybe_paid(rid)
            else None
        )
        if lost and not (self.settings.resend_interrupted or not self.backend.paid):
            log.warning(
                "%s/%s turn %d %s: it may be paid and is not sent again (generation.resend_interrupted: "
                "true sends it again)",
                self.dataset,
                conv_id,
                turn,
                lost,
            )
            st.num_conversations_interrupted += 1
            st.num_requests_held_back_maybe_paid += 1
            return None
        if self.stop:
            return None
        reserved = await self.budget.reserve(history)
        if reserved is None:
            self.stop = st.stopped_by_budget = True
            return None
        tried = _Try(reserved)

        async def before_resend() -> bool:
            """The last try timed out after reaching the provider: booked at its bound; reserve for the next."""
            tried.open = False
            await self.budget.settle(tried.bound, tried.bound)
            self._book(tried.bound)
            st.num_tries_maybe_paid += 1
            bound = None if self.stop else await self.budget.reserve(history)
            if bound is None:
                self.stop = st.stopped_by_budget = True
                return False
            store.mark_sent(rid, bound)
            tried.bound, tried.open = bound, True
            return True

        try:
            store.mark_sent(rid, reserved)
            st.num_requests += 1
            result = await self.backend.complete(
                list(history),
                request_id=rid,
                max_tokens=self.settings.max_new_tokens,
                temperature=self.settings.temperature,
                reasoning=self.settings.reasoning,
                before_resend=before_resend,
            )
        except ChatRequestError as e:
            last_maybe_paid = e.maybe_paid and self.backend.paid  # the last try: booked at its bound
            held = e.num_maybe_paid > 0 and self.backend.paid  # any try: a rerun does not send it again
            paid = e.paid and self.backend.paid
            malformed = (
                paid
                and not last_maybe_paid
                and self._malformed_usage(rid, conv_id, turn, e.usage_problems, tried.bound)
            )
            spent = (
                tried.bound
                if last_maybe_paid
                else self.budget.booked(tried.bound, cost=e.cost, usage=e.usage, paid=paid, malformed=malformed)
            )
            # a paid failure is on record before any re-send
            store.mark_failed(rid, e.kind, cost_usd=spent, maybe_paid=held)
            if tried.open:
                await self.budget.settle(tried.bound, spent)
                self._book(spent)
                st.num_tries_maybe_paid += last_maybe_paid
            st.num_failed_maybe_paid += held
            st.num_paid_unusable += paid
            self.failures[e.kind] += 1
            self.attempt_failures.update(e.attempt_failures)
            st.num_conversations_failed += 1
            log.warning("%s/%s turn %d failed: %s", self.dataset, conv_id, turn, e)
            return None
        except BaseException:
            if tried.open:  # cancelled: the try stays `sent` in the log, booked at its bound
                await self.budget.settle(tried.bound, tried.bound)
            raise
        malformed = self.backend.paid and self._malformed_usage(rid, conv_id, turn, result.usage_problems, tried.bound)
        spent = self.budget.booked(
            tried.bound, cost=result.cost, usage=result.usage, paid=self.backend.paid, malformed=malformed
        )
        self.attempt_failures.update(result.attempt_failures)
        record = _turn_record(rid, self.dataset, conv_id, turn, history, result, self.settings, spent)
        store.add_turn(record)
        await self.budget.settle(tried.bound, spent)
        self._book(spent)
        st.num_turns += 1
        st.num_successes += 1
        st.prompt_tokens += int(result.usage.get("prompt_tokens", 0))
        st.completion_tokens += int(result.usage.get("completion_tokens", 0))
        st.reasoning_tokens += int(result.usage.get("reasoning_tokens", 0))
        return record

    def _malformed_usage(self, rid: str, conv_id: str, turn: int, problems: tuple[str, ...], bound: float) -> bool:
        """A paid reply whose usage could not be booked as reported: counted, named, booked at its bound."""
        if not problems:
            return False
        self.stats.num_replies_usage_malformed += 1
        log.warning(
            "%s/%s turn %d (request %s): the provider's %s; the reply is booked at its bound $%.6f (the "
            "most it could cost)",
            self.dataset,
            conv_id,
            turn,
            rid,
            "; ".join(problems),
            bound,
        )
        return True

    def _book(self, spent: float) -> None:
        self.stats.cost_usd += spent
        self.stats.recorded_cost_usd = self.store.recorded_cost_usd


@dataclass
class _Try:
    """The latest try of a request: its reserved bound, and whether the budget still holds it as reserved."""

    bound: float
    open: bool = True


def _turn_record(
    rid: str,
    dataset: str,
    conv_id: str,
    turn: int,
    history: list[dict],
    result: ChatResult,
    settings: GenerationSettings,
    cost_usd: float,
) -> dict:
    return {
        "request_id": rid,
        "dataset": dataset,
        "conversation_id": conv_id,
        "turn": turn,
        "messages": history,  # exactly the prompt this answer was generated from
        "response": {
            "reasoning": result.reasoning,
            "content": result.content,
            "tool_calls": result.tool_calls,
            "finish_reason": result.finish_reason,
            **({"completion_ids": result.completion_ids} if result.completion_ids is not None else {}),
        },
        "usage": result.usage,
        "cost_usd": cost_usd,
        "cost_reported": result.cost is not None,
        **({"usage_problems": list(result.usage_problems)} if result.usage_problems else {}),
        "provider": result.provider,
        "model": result.model,
        "settings": settings.identity(),
        "attempt_failures": result.attempt_failures,
        **({"producer": settings.producer} if settings.producer else {}),
    }


def _history_message(response: dict) -> dict:
    msg: dict = {"role": "assistant", "content": response["content"]}
    if response.get("reasoning"):
        msg["reasoning_content"] = response["reasoning"]
    if response.get("tool_calls"):
        msg["tool_calls"] = response["tool_calls"]
    return msg


def _report_progress(meter: ProgressMeter, run: _Run, *, finished: bool = False) -> None:
    """The shared progress line, counted in conversations, with the requests and the money spent so far.

    `total` is the dataset's cap (max_conversations) until the source runs out: then it is what it held."""
    st = run.stats
    done = st.num_conversations_complete + st.num_conversations_failed + st.num_conversations_interrupted
    total = done if finished and not run.stop else None
    meter.update(done, total, note=f"{st.num_requests:,} requests, ${st.cost_usd:.4f}", force=True)


async def regenerate_dataset(
    conversations: Iterable[Conversation],
    store_path: Path,
    backend: ChatBackend,
    settings: GenerationSettings,
    *,
    dataset: str,
    total: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> RegenerationStats:
    """Regenerate every conversation into the store at `store_path`, reusing what an earlier run recorded."""
    if total is None and hasattr(conversations, "__len__"):
        total = len(conversations)  # type: ignore[arg-type]
    started = time.monotonic()
    meter = ProgressMeter(
        progress or no_progress, f"raw_responses[{dataset}]", "conversations", total, every_s=settings.progress_every_s
    )
    with ResponseStore(store_path) as store:
        run = _Run(store, backend, settings, dataset)
        slots = asyncio.Semaphore(settings.concurrency)
        tasks: set[asyncio.Task] = set()

        async def worker(conv: Conversation) -> None:
            try:
                await run.conversation(conv)
            finally:
                slots.release()

        async def report() -> None:
            while True:
                await asyncio.sleep(settings.progress_every_s)
                _report_progress(meter, run)

        reporter = asyncio.create_task(report()) if progress else None
        try:
            for conv in conversations:  # lazily: the dataset is never held in memory
                await slots.acquire()
                if run.stop:
                    slots.release()
                    break
                task = asyncio.create_task(worker(conv))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)  # in-flight requests finish and are recorded, also after a stop
        finally:
            if reporter:
                reporter.cancel()
        run.stats.failures_by_kind = dict(run.failures)
        run.stats.attempt_failures_by_kind = dict(run.attempt_failures)
        run.stats.wall_s = time.monotonic() - started
        if progress:
            _report_progress(meter, run, finished=True)
    _check_failures(run.stats, settings.max_failure_fraction, store_path)
    return run.stats


def _check_failures(stats: RegenerationStats, max_fraction: float, store_path: Path) -> None:
    failed = sum(stats.failures_by_kind.values())
    if stats.num_requests and failed / stats.num_requests > max_fraction:
        kinds = ", ".join(f"{k}: {n}" for k, n in sorted(stats.failures_by_kind.items(), key=lambda kv: -kv[1]))
        held = stats.num_failed_maybe_paid
        rerun = (
            "a rerun sends the failed ones again"
            if not held
            else (
                f"a rerun sends the failed ones again, except the {held} that timed out after reaching the provider "
                f"(they may be paid, each is booked at its bound; generation.resend_interrupted: true sends them too)"
            )
        )
        raise RegenerationFailedError(
            f"{stats.dataset}: {failed} of {stats.num_requests} requests failed for good ({kinds}), more than "
            f"generation.max_failure_fraction={max_fraction:g}; the {stats.num_turns} turns that came back are "
            f"recorded in {store_path} and {rerun}",
            stats,
        )


def regenerate_dataset_sync(
    conversations: Iterable[Conversation],
    store_path: Path,
    backend: ChatBackend,
    settings: GenerationSettings,
    *,
    dataset: str,
    total: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> RegenerationStats:
    """For the asset: runs the loop and closes the backend (an httpx client belongs to one event loop)."""

    async def main() -> RegenerationStats:
        try:
            return await regenerate_dataset(
                conversations, store_path, backend, settings, dataset=dataset, total=total, progress=progress
            )
        finally:
            await backend.aclose()

    return asyncio.run(main())
