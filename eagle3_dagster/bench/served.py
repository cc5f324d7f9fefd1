"""The served benchmark: chat-templated prompts against a running SGLang server.

Owns the client side only: readiness, `/generate` requests with bounded
concurrency, SGLang's acceptance accounting (`meta_info.spec_verify_ct`,
acceptance length = Σ completion_tokens / Σ spec_verify_ct, as SGLang's
bench_serving and SpecForge compute it), the server-wide
`avg_spec_accept_length`, throughput and latency. Starting and stopping the
server belongs to the caller's `launch` context manager (the GPU-host
resource); `run_served_benchmark` enters it, so the server is stopped however
the run ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import httpx
import numpy as np

from eagle3_dagster.bench.report import make_row


class ServedBenchmarkError(RuntimeError):
    """The server failed or answered something unusable; the message names the server and the prompt."""


def wait_ready(base_url: str, timeout_s: float = 600.0, poll_s: float = 1.0) -> None:
    """Poll `/health` until it answers 200 (it is 503 while SGLang is still loading)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{base_url}/health", timeout=poll_s * 5)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.TransportError as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(poll_s)
    raise ServedBenchmarkError(f"SGLang server {base_url} not healthy after {timeout_s:.0f}s ({last})")


def server_accept_length(base_url: str) -> float | None:
    """Server-wide `avg_spec_accept_length`: top level in older SGLang, `internal_states[0]` in newer."""
    for path in ("/server_info", "/get_server_info"):
        try:
            r = httpx.get(f"{base_url}{path}", timeout=30)
        except httpx.TransportError as e:
            raise ServedBenchmarkError(f"SGLang server {base_url} unreachable on {path}: {e}") from None
        if r.status_code == 404:
            continue
        if r.status_code != 200:
            raise ServedBenchmarkError(f"SGLang server {base_url}{path}: HTTP {r.status_code}: {r.text[:200]}")
        info = r.json()
        if "avg_spec_accept_length" in info:
            return info["avg_spec_accept_length"]
        states = info.get("internal_states") or [{}]
        return states[0].get("avg_spec_accept_length")
    return None


async def _health_line(client: httpx.AsyncClient, base_url: str) -> str:
    try:
        r = await client.get(f"{base_url}/health", timeout=5)
        return f"the server still answers /health with HTTP {r.status_code}"
    except httpx.TransportError:
        return "the server no longer answers /health (its process has probably died)"


async def _one(
    client: httpx.AsyncClient, sem: asyncio.Semaphore, base_url: str, where: str, input_ids: Sequence[int],
    max_new_tokens: int,
) -> dict[str, Any]:
    body = {"input_ids": list(input_ids), "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    async with sem:
        start = time.perf_counter()
        try:
            r = await client.post(f"{base_url}/generate", json=body)
        except httpx.TransportError as e:
            health = await _health_line(client, base_url)
            raise ServedBenchmarkError(
                f"SGLang server {base_url} failed on prompt {where}: {type(e).__name__}: {e}; {health}"
            ) from None
        latency = time.perf_counter() - start
    if r.status_code != 200:
        health = await _health_line(client, base_url)
        raise ServedBenchmarkError(
            f"SGLang server {base_url} answered HTTP {r.status_code} for prompt {where}: {r.text[:300]}; {health}"
        )
    try:
        meta = r.json()["meta_info"]
        completion = int(meta["completion_tokens"])
    except (ValueError, KeyError, TypeError) as e:
        raise ServedBenchmarkError(f"SGLang server {base_url}: unusable /generate answer for prompt {where}: {e!r}")
    return {"latency_s": latency, "completion_tokens": completion, "verify_ct": int(meta.get("spec_verify_ct") or 0),
            "e2e_latency_s": meta.get("e2e_latency")}


async def _run_set(
    base_url: str, set_name: str, prompts: Sequence[tuple[str, Sequence[int]]], max_new_tokens: int,
    concurrency: int, request_timeout_s: float,
) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=request_timeout_s, limits=limits) as client:
        start = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(_one(client, sem, base_url, f"{set_name}/{pid}", ids, max_new_tokens))
                         for pid, ids in prompts]
        except* ServedBenchmarkError as group:  # the first failure stops the set; the others are cancelled
            raise group.exceptions[0] from None
        wall = time.perf_counter() - start
    return [t.result() for t in tasks], wall


def run_served_benchmark(
    launch: Callable[[], AbstractContextManager[str]],
    prompt_sets: Mapping[str, Sequence[tuple[str, Sequence[int]]]],
    *,
    method: str,
    spec: str | None,
    max_new_tokens: int,
    concurrency: int = 8,
    request_timeout_s: float = 600.0,
    ready_timeout_s: float = 600.0,
    log: Callable[[str], None] = lambda _msg: None,
) -> list[dict]:
    """Serve every set under one server configuration; one result row per set.

    `launch()` starts the server and yields its base URL; leaving it stops the server, also when
    a request fails. `method`/`spec` label the rows ("no_spec", None) or ("eagle3", "3,1,4").
    """
    rows = []
    with launch() as base_url:
        base_url = base_url.rstrip("/")
        wait_ready(base_url, ready_timeout_s)
        for set_name, prompts in prompt_sets.items():
            results, wall = asyncio.run(
                _run_set(base_url, set_name, prompts, max_new_tokens, concurrency, request_timeout_s)
            )
            verify_ct = sum(r["verify_ct"] for r in results)
            if spec and not verify_ct:
                raise ServedBenchmarkError(
                    f"SGLang server {base_url} reports no spec_verify_ct for set {set_name} although {method} "
                    f"{spec} was requested: was it launched with --speculative-algorithm?"
                )
            latencies = np.array([r["latency_s"] for r in results])
            e2e = [r["e2e_latency_s"] for r in results if r["e2e_latency_s"] is not None]
            completion = sum(r["completion_tokens"] for r in results)
            rows.append(make_row(
                set_name, method, spec,
                num_prompts=len(prompts), prompt_tokens=sum(len(ids) for _, ids in prompts),
                completion_tokens=completion, wall_s=wall, verify_ct=verify_ct, verify_tokens=completion,
                concurrency=concurrency,
                latency_mean_s=float(latencies.mean()) if len(latencies) else None,
                latency_p50_s=float(np.percentile(latencies, 50)) if len(latencies) else None,
                latency_p90_s=float(np.percentile(latencies, 90)) if len(latencies) else None,
                server_e2e_latency_mean_s=float(np.mean(e2e)) if e2e else None,
                # server-wide and cumulative since launch: after the first set it mixes sets
                server_avg_accept_length=server_accept_length(base_url) if spec else None,
            ))
            log(f"{set_name}: {method} {spec or ''} {rows[-1]['tokens_per_s']:.1f} tok/s, "
                f"acceptance length {rows[-1]['acceptance_length']}")
    return rows
