"""The in-process backend batches concurrent requests without changing any answer."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from eagle3_dagster.generate.client import ChatRequestError
from eagle3_dagster.generate.local_backend import LocalChatBackend

PROMPTS = [
    "Hi",
    "What is the capital of France?",
    "Write a short poem about the sea, the wind and the long grey evenings by the harbour.",
    "ok",
    "Explain step by step how a hash table resolves collisions, and compare chaining with open addressing "
    "in terms of memory use, cache behaviour and worst-case lookup time.",
    "Tell me a joke.",
    "List three prime numbers greater than one hundred.",
    "Why is the sky blue? Answer in one sentence, please, and do not use any technical words at all.",
]


# One batch of every prompt: the worker stops gathering at max_batch arrivals, long before the wait bound.
ALL_AT_ONCE = {"max_batch": len(PROMPTS), "batch_wait_s": 120.0}


def _messages(prompt: str) -> list[dict]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]


async def _complete_all(
    backend: LocalChatBackend,
    prompts: list[str],
    *,
    max_tokens: int | list[int] = 24,
    temperature: float = 0.0,
    reasoning: bool = True,
) -> list:
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    try:
        return await asyncio.gather(
            *(
                backend.complete(
                    _messages(p), request_id=f"r{i}", max_tokens=n, temperature=temperature, reasoning=reasoning
                )
                for i, (p, n) in enumerate(zip(prompts, limits))
            ),
            return_exceptions=True,
        )
    finally:
        await backend.aclose()


def _record_rows(backend: LocalChatBackend) -> dict[str, list[int]]:
    """Generated token ids per request id, as the batch split them."""
    rows: dict[str, list[int]] = {}
    generate = backend._generate

    def spy(batch):
        out = generate(batch)
        rows.update({r.request_id: row for r, row in zip(batch, out)})
        return out

    backend._generate = spy
    return rows


def _count_generate_calls(backend: LocalChatBackend) -> list[dict]:
    calls: list[dict] = []
    generate = backend.model.generate

    def counted(input_ids, **kw):
        calls.append({"batch": input_ids.shape[0], "max_new_tokens": kw["max_new_tokens"]})
        return generate(input_ids, **kw)

    backend.model.generate = counted
    return calls


def test_greedy_batched_answers_equal_one_at_a_time_token_for_token(micro_target):
    # ALL_AT_ONCE: the worker waits for every prompt (an arrival, not a time window), so the batch is certain
    single, batched = LocalChatBackend(micro_target, max_batch=1), LocalChatBackend(micro_target, **ALL_AT_ONCE)
    single_rows, batched_rows = _record_rows(single), _record_rows(batched)
    batched_calls = _count_generate_calls(batched)
    expected = asyncio.run(_complete_all(single, PROMPTS))
    got = asyncio.run(_complete_all(batched, PROMPTS))
    assert max(c["batch"] for c in batched_calls) > 1, "the prompts were never batched together"
    assert len({len(single.tokenizer(p)["input_ids"]) for p in PROMPTS}) > 4, "prompts must need left padding"
    assert batched_rows == single_rows
    assert got == expected
    assert all(r.usage["completion_tokens"] == len(single_rows[f"r{i}"]) for i, r in enumerate(got))
    assert {r.finish_reason for r in got} <= {"stop", "length"}


def test_concurrent_requests_share_one_generate_call_per_max_tokens_and_temperature(micro_target):
    backend = LocalChatBackend(micro_target, **ALL_AT_ONCE)
    calls = _count_generate_calls(backend)
    results = asyncio.run(_complete_all(backend, PROMPTS, max_tokens=[8, 12] * 4))
    assert sorted((c["max_new_tokens"], c["batch"]) for c in calls) == [(8, 4), (12, 4)]
    for i, r in enumerate(results):
        assert 1 <= r.usage["completion_tokens"] <= [8, 12][i % 2]
        assert (r.finish_reason == "length") == (r.usage["completion_tokens"] == [8, 12][i % 2])


def test_max_batch_caps_the_batch_size(micro_target):
    backend = LocalChatBackend(micro_target, max_batch=3)
    calls = _count_generate_calls(backend)
    asyncio.run(_complete_all(backend, PROMPTS, max_tokens=4))
    assert sum(c["batch"] for c in calls) == len(PROMPTS)
    assert max(c["batch"] for c in calls) <= 3 and len(calls) < len(PROMPTS)


def test_sampled_answers_do_not_depend_on_which_requests_share_the_batch(micro_target):
    """Each request samples from its own stream (seeded by its id): batched or alone, the same tokens."""
    single, batched = LocalChatBackend(micro_target, max_batch=1), LocalChatBackend(micro_target, **ALL_AT_ONCE)
    single_rows, batched_rows = _record_rows(single), _record_rows(batched)
    alone = asyncio.run(_complete_all(single, PROMPTS, temperature=0.8))
    together = asyncio.run(_complete_all(batched, PROMPTS, temperature=0.8))
    assert batched_rows == single_rows and together == alone
    assert together != asyncio.run(_complete_all(LocalChatBackend(micro_target, **ALL_AT_ONCE), PROMPTS))  # sampled


def test_row_sampler_draws_from_the_tempered_softmax_with_one_stream_per_row():
    from eagle3_dagster.generate.local_backend import RowSampler

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    draws = 20_000
    sampler = RowSampler(list(range(draws)), temperature=0.7)
    picked = sampler(torch.zeros(draws, 1), logits.expand(draws, 4)).argmax(-1)
    freq = torch.bincount(picked, minlength=4).double() / draws
    torch.testing.assert_close(freq, torch.softmax(logits.double() / 0.7, -1), atol=0.012, rtol=0)
    # a row's draw depends on its own seed only, not on the rows beside it
    alone = RowSampler([7], 0.7)(torch.zeros(1, 1), logits[None])
    among = RowSampler([3, 7, 9], 0.7)(torch.zeros(3, 1), logits.expand(3, 4))[1]
    torch.testing.assert_close(alone[0], among)


def test_sampled_answers_repeat_for_the_same_batch_of_request_ids(micro_target):
    backend = LocalChatBackend(micro_target, max_batch=8)
    first = asyncio.run(_complete_all(backend, PROMPTS, temperature=1.0))
    second = asyncio.run(_complete_all(backend, PROMPTS, temperature=1.0))
    assert first == second
    assert first != asyncio.run(_complete_all(backend, PROMPTS, temperature=0.0))


def test_a_failed_generate_fails_its_batch_and_the_backend_keeps_serving(micro_target):
    backend = LocalChatBackend(micro_target, max_batch=8)
    generate = backend.model.generate
    failures = iter([RuntimeError("simulated out of memory")])

    def flaky(*args, **kw):
        for e in failures:
            raise e
        return generate(*args, **kw)

    backend.model.generate = flaky
    failed = asyncio.run(_complete_all(backend, PROMPTS[:4], max_tokens=4))
    assert all(isinstance(e, ChatRequestError) and e.kind == "local_error" for e in failed)
    assert "simulated out of memory" in str(failed[0])
    served = asyncio.run(_complete_all(backend, PROMPTS[:4], max_tokens=4))
    assert all(r.provider == "local" and r.usage["completion_tokens"] >= 1 for r in served)


def test_a_prompt_the_template_rejects_fails_alone(micro_target):
    backend = LocalChatBackend(micro_target, max_batch=8)

    async def run():
        try:
            return await asyncio.gather(
                backend.complete(
                    [{"role": "user", "content": "fine"}],
                    request_id="ok",
                    max_tokens=4,
                    temperature=0.0,
                    reasoning=True,
                ),
                backend.complete(
                    [
                        {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "", "tool_calls": [{"id": "no function"}]},
                    ],
                    request_id="bad",
                    max_tokens=4,
                    temperature=0.0,
                    reasoning=True,
                ),
                return_exceptions=True,
            )
        finally:
            await backend.aclose()

    ok, bad = asyncio.run(run())
    assert ok.usage["completion_tokens"] >= 1
    assert isinstance(bad, ChatRequestError) and bad.kind == "local_error"
    assert "request bad: chat template failed" in str(bad)


def test_aclose_stops_the_worker_thread(micro_target):
    backend = LocalChatBackend(micro_target)
    asyncio.run(_complete_all(backend, PROMPTS[:2], max_tokens=2))
    assert not [t for t in threading.enumerate() if t.name == "local-generate"]
    assert "max_batch" not in repr(backend) and repr(backend).startswith("LocalChatBackend(model_dir=")


def test_max_batch_must_be_positive(micro_target):
    with pytest.raises(ValueError, match="max_batch"):
        LocalChatBackend(micro_target, max_batch=0)
