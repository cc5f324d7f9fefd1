"""The served benchmark: token-id prompts against an SGLang server started on the GPU host.

Two halves, because the server binds 127.0.0.1 on the GPU host and the Dagster
code location may run elsewhere:

- `run_on_host` (code location): starts the server through the GPU-host runner
  (which checks that the server answering is the one it launched), writes the
  prompts to a file on the host, runs the client there and parses its rows.
  The prompts travel as a file written through the host command's stdin, not
  on the client's stdin: a spawned process's stdin is the watchdog's lifeline
  (EOF means the worker died), and a file also leaves a record beside the run.
- the client (`python -m eagle3_dagster.bench.served`, on the GPU host): checks
  the server's name (`sglang.health.served_names`, the health wait's lookup),
  sends `/generate` requests with bounded concurrency and prints one
  `EAGLE3_BENCH_ROW {json}` line per prompt set.

Acceptance is reported three ways side by side: the client's Σ completion_tokens
/ Σ spec_verify_ct (as SGLang's bench_serving and SpecForge compute it), the mean
of SGLang's own per-request `meta_info.spec_accept_length`, and the server-wide
`avg_spec_accept_length` from `/server_info` (`internal_states[0]`, cumulative
since launch, so after the first set it mixes sets).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.error
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from eagle3_dagster.sglang import health

if TYPE_CHECKING:
    from eagle3_dagster.gpu_host import GpuHost
    from eagle3_dagster.sglang.server import ServerSpec

ROW_PREFIX = "EAGLE3_BENCH_ROW "
PromptSets = Mapping[str, Sequence[tuple[str, Sequence[int]]]]


class ServedBenchmarkError(RuntimeError):
    """The server failed or answered something unusable; the message names the server and the prompt."""


def prompt_token_limit(serving_context: int, max_new_tokens: int, max_prompt_tokens: int | None = None) -> int:
    """The longest prompt that leaves room for `max_new_tokens` in the serving context."""
    if max_new_tokens >= serving_context:
        raise ValueError(
            f"bench.max_new_tokens ({max_new_tokens}) leaves no room for a prompt in "
            f"target.serving_context ({serving_context})"
        )
    limit = serving_context - max_new_tokens
    return limit if max_prompt_tokens is None else min(limit, max_prompt_tokens)


def server_accept_length(base_url: str) -> float | None:
    """Server-wide `avg_spec_accept_length`: `internal_states[0]` (top level in older SGLang)."""
    try:
        r = httpx.get(f"{base_url}/server_info", timeout=30)
    except httpx.TransportError as e:
        raise ServedBenchmarkError(f"SGLang server {base_url} unreachable on /server_info: {e}") from None
    if r.status_code != 200:
        raise ServedBenchmarkError(f"SGLang server {base_url}/server_info: HTTP {r.status_code}: {r.text[:200]}")
    info = r.json()
    if "avg_spec_accept_length" in info:
        return info["avg_spec_accept_length"]
    states = info.get("internal_states") or [{}]
    return states[0].get("avg_spec_accept_length")


async def _health_line(client: httpx.AsyncClient, base_url: str) -> str:
    try:
        r = await client.get(f"{base_url}/health", timeout=5)
        return f"the server still answers /health with HTTP {r.status_code}"
    except httpx.TransportError:
        return "the server no longer answers /health (its process has probably died)"


async def _one(
    client: httpx.AsyncClient,
    sem: asyncio.Semaphore,
    base_url: str,
    where: str,
    input_ids: Sequence[int],
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
        raise ServedBenchmarkError(
            f"SGLang server {base_url}: unusable /generate answer for prompt {where}: {e!r}"
        ) from e
    return {
        "latency_s": latency,
        "completion_tokens": completion,
        "verify_ct": int(meta.get("spec_verify_ct") or 0),
        "spec_accept_length": meta.get("spec_accept_length"),
        "e2e_latency_s": meta.get("e2e_latency"),
    }


async def _run_set(
    base_url: str,
    set_name: str,
    prompts: Sequence[tuple[str, Sequence[int]]],
    max_new_tokens: int,
    concurrency: int,
    request_timeout_s: float,
) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=request_timeout_s, limits=limits) as client:
        start = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(_one(client, sem, base_url, f"{set_name}/{pid}", ids, max_new_tokens))
                    for pid, ids in prompts
                ]
        except* ServedBenchmarkError as group:  # the first failure stops the set; the others are cancelled
            raise group.exceptions[0] from None
        wall = time.perf_counter() - start
    return [t.result() for t in tasks], wall


def run_served_sets(
    base_url: str,
    prompt_sets: PromptSets,
    *,
    method: str,
    spec: str | None,
    max_new_tokens: int,
    served_model_name: str | None = None,
    concurrency: int = 8,
    request_timeout_s: float = 600.0,
    log: Callable[[str], None] = lambda _msg: None,
) -> list[dict]:
    """Every set against the running server; one result row per set (`report.make_row`)."""
    from eagle3_dagster.bench.report import make_row

    base_url = base_url.rstrip("/")
    if served_model_name is not None:
        try:  # the lookup the health wait does beside the server
            names = health.served_names(base_url)
        except urllib.error.HTTPError as e:
            raise ServedBenchmarkError(f"SGLang server {base_url}: /v1/models answered HTTP {e.code}") from None
        if served_model_name not in names:
            raise ServedBenchmarkError(
                f"SGLang server {base_url} serves {names}, not {served_model_name!r}: "
                "another server answers on this port"
            )
    rows = []
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
        per_request = [r["spec_accept_length"] for r in results if r["spec_accept_length"] is not None]
        completion = sum(r["completion_tokens"] for r in results)
        rows.append(
            make_row(
                set_name,
                method,
                spec,
                num_prompts=len(prompts),
                prompt_tokens=sum(len(ids) for _, ids in prompts),
                completion_tokens=completion,
                wall_s=wall,
                verify_ct=verify_ct,
                verify_tokens=completion,
                concurrency=concurrency,
                latency_mean_s=float(latencies.mean()) if len(latencies) else None,
                latency_p50_s=float(np.percentile(latencies, 50)) if len(latencies) else None,
                latency_p90_s=float(np.percentile(latencies, 90)) if len(latencies) else None,
                server_e2e_latency_mean_s=float(np.mean(e2e)) if e2e else None,
                # SGLang's own figures next to the client's Σcompletion/Σverify_ct (`acceptance_length`)
                sglang_request_accept_length_mean=float(np.mean(per_request)) if per_request else None,
                num_requests_with_accept_length=len(per_request),
                server_avg_accept_length=server_accept_length(base_url) if spec else None,
            )
        )
        log(
            f"{set_name}: {method} {spec or ''} {rows[-1]['tokens_per_s']:.1f} tok/s, "
            f"acceptance length {rows[-1]['acceptance_length']}"
        )
    return rows


def run_on_host(
    host: "GpuHost",
    server: "ServerSpec",
    prompt_sets: PromptSets,
    *,
    method: str,
    spec: str | None,
    max_new_tokens: int,
    concurrency: int = 8,
    request_timeout_s: float = 600.0,
    log: Callable[[str], None] = lambda _msg: None,
) -> list[dict]:
    """Start `server` on the host, run the client beside it, return its rows; the server is always stopped."""
    from eagle3_dagster.sglang.server import sglang_server

    if server.context_length is not None:
        for set_name, prompts in prompt_sets.items():
            for pid, ids in prompts:
                if len(ids) + max_new_tokens > server.context_length:
                    raise ValueError(
                        f"prompt {set_name}/{pid}: {len(ids)} tokens + max_new_tokens {max_new_tokens} "
                        f"exceed the serving context {server.context_length}"
                    )
    lines = b"".join(
        json.dumps({"set": s, "id": pid, "input_ids": list(ids)}).encode() + b"\n"
        for s, prompts in prompt_sets.items()
        for pid, ids in prompts
    )
    with sglang_server(host, server, on_log=lambda line: log(f"[sglang] {line}")) as running:
        prompts_file = f"bench/prompts-{running.served_model_name}.jsonl"
        host.write_file(prompts_file, lines)
        argv = [
            host.spec.python,
            "-m",
            "eagle3_dagster.bench.served",
            "--base-url",
            running.base_url,
            "--served-model-name",
            running.served_model_name,
            "--prompts",
            prompts_file,
            "--method",
            method,
            "--max-new-tokens",
            str(max_new_tokens),
            "--concurrency",
            str(concurrency),
            "--request-timeout-s",
            str(request_timeout_s),
            *(["--spec", spec] if spec else []),
        ]
        client = host.spawn(argv, {}, f"bench-client-{server.port}")
        rows, said = [], []
        assert client.proc.stdout is not None  # spawned with stdout=PIPE
        for line in client.proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(ROW_PREFIX):
                rows.append(json.loads(line[len(ROW_PREFIX) :]))
            else:
                said.append(line)
                log(line)
        returncode = client.proc.wait()
        client.release()
    if returncode != 0:
        raise ServedBenchmarkError(
            f"the benchmark client on {host.where()} exited {returncode}:\n" + "\n".join(said[-30:])
        )
    return rows


def read_prompt_file(path: str) -> dict[str, list[tuple[str, list[int]]]]:
    sets: dict[str, list[tuple[str, list[int]]]] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                record = json.loads(line)
                sets.setdefault(str(record["set"]), []).append(
                    (str(record["id"]), [int(t) for t in record["input_ids"]])
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ServedBenchmarkError(f"{path}: line {n}: not a prompt record ({e!r})") from None
    return sets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_dagster.bench.served", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--served-model-name", help="refuse a server that does not answer with this name")
    parser.add_argument("--prompts", required=True, help="jsonl: {set, id, input_ids} per line")
    parser.add_argument("--method", required=True)
    parser.add_argument("--spec", default=None, help="e.g. 3,1,4; absent: no speculation")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    try:
        rows = run_served_sets(
            args.base_url,
            read_prompt_file(args.prompts),
            method=args.method,
            spec=args.spec,
            max_new_tokens=args.max_new_tokens,
            served_model_name=args.served_model_name,
            concurrency=args.concurrency,
            request_timeout_s=args.request_timeout_s,
            log=lambda line: print(line, flush=True),
        )
    except ServedBenchmarkError as e:
        print(f"ServedBenchmarkError: {e}", flush=True)
        return 1
    for row in rows:
        print(ROW_PREFIX + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
