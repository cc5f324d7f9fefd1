"""The SGLang extraction driver: prefill every sample of a shard on the patched server, assemble the shard.

Owns the client side of the dump boundary. Each sample goes to the native
`/generate` endpoint as a prefill-only request (`input_ids`, `max_new_tokens: 0`,
`rid` = the sample id) with bounded concurrency; once a request returns, its
chunk files (`dump_hook`) are stitched by absolute position, checked (every
position present exactly once, token ids equal to the sample's, shapes) and
written into the standard shard (`eagle3_dagster.hidden.shards.ShardWriter`),
whose manifest is the only proof of completion. Chunk files are deleted once the
shard is committed.

The driver must see the same file system as the server's `SGLANG_HS_DUMP_DIR`
(`dump_folder`), so on a remote GPU host it runs there: `stages/hidden.py`
launches it on the host with the plan's path and a shard key, as it does the hf
backend's `hidden/hf_driver.py`. It needs the server launched as
`sglang.server.ServerSpec` launches it for extraction: radix cache off (a cached
prefix produces no states; `cached_tokens > 0` is an error here), and CUDA
graphs off for prefill.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import orjson
import torch
from safetensors import safe_open
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from eagle3_dagster import storage
from eagle3_dagster.contracts import SGLANG_BACKEND_CODE_VERSION
from eagle3_dagster.hidden.extraction_plan import ExtractionPlan, load_plan
from eagle3_dagster.hidden.extract import Progress, Rows, ShardResult, extract_shard
from eagle3_dagster.hidden.sharding import SampleRecord, ShardSpec
from eagle3_dagster.hidden.shards import ShardFormat
from eagle3_dagster.sglang.dump_hook import content_key


@dataclass(frozen=True)
class DriverSettings:
    base_url: str  # e.g. http://127.0.0.1:30000
    dump_dir: Path  # the server's SGLANG_HS_DUMP_DIR
    concurrency: int = 8
    request_timeout_s: float = 600.0
    dump_wait_s: float = 120.0  # how long a returned request's chunk files may take to land
    keep_dumps: bool = False


class DumpError(RuntimeError):
    """A sample's dump is missing, incomplete or inconsistent; the message names the sample."""


@retry(
    retry=retry_if_exception_type((httpx.TransportError, httpx.HTTPStatusError)),
    stop=stop_after_attempt(4),
    wait=wait_exponential(min=1, max=20),
    reraise=True,
)
def prefill(client: httpx.Client, sample: SampleRecord) -> dict:
    """One prefill-only request; returns its meta_info."""
    body = {"input_ids": sample.input_ids, "sampling_params": {"max_new_tokens": 0}, "rid": sample.id}
    resp = client.post("/generate", json=body)
    if resp.status_code == 400:  # a request SGLang rejects will not succeed on retry
        raise DumpError(f"sample {sample.id!r}: /generate rejected the request: {resp.text[:500]}")
    resp.raise_for_status()
    meta = resp.json().get("meta_info", {})
    if meta.get("cached_tokens", 0):
        raise DumpError(
            f"sample {sample.id!r}: {meta['cached_tokens']} prompt tokens came from the prefix cache and have no "
            "hidden states; launch the server with --disable-radix-cache"
        )
    return meta


def _chunk_files(dump_dir: Path, key: str) -> list[tuple[int, Path]]:
    prefix = quote(key, safe="") + "."
    out = []
    for p in dump_dir.glob(f"{prefix}*.safetensors"):
        start = p.name[len(prefix) : -len(".safetensors")]
        if start.isdigit():
            out.append((int(start), p))
    return sorted(out)


def _covered(chunks: list[tuple[int, Path]], length: int) -> bool:
    total = 0
    for _start, p in chunks:
        with safe_open(str(p), "pt") as f:
            total += int(f.metadata()["length"])
    return total >= length


def find_sample_chunks(dump_dir: Path, sample: SampleRecord, wait_s: float) -> list[tuple[int, Path]]:
    """The sample's chunk files (by rid, or by content on SGLang without rids), waiting for late writes."""
    deadline = time.monotonic() + wait_s
    while True:
        for key in (sample.id, content_key(sample.input_ids)):
            chunks = _chunk_files(dump_dir, key)
            if chunks and _covered(chunks, len(sample.input_ids)):
                return chunks
        if time.monotonic() >= deadline:
            raise DumpError(
                f"sample {sample.id!r}: no complete dump in {dump_dir} after {wait_s:g}s "
                f"(found chunks at positions {[s for s, _ in chunks]}); is the server patched and "
                "SGLANG_HS_DUMP_DIR pointing here?"
            )
        time.sleep(0.05)


def assemble_sample(
    chunks: list[tuple[int, Path]], sample: SampleRecord, aux_layers: list[int], hidden_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stitch chunks into (aux_hidden [T, 3H] in aux_layers order, last_hidden [T, H]), checking every position."""
    parts: dict[str, list[torch.Tensor]] = {}
    expected_start = 0
    for start, path in chunks:
        if start != expected_start:
            raise DumpError(
                f"sample {sample.id!r}: dump chunk {path.name} starts at {start}, expected {expected_start}"
            )
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            names = ["input_ids", "last_hidden", *(f"hidden.{i}" for i in aux_layers)]
            missing = [n for n in names if n not in f.keys()]
            if missing:
                raise DumpError(
                    f"sample {sample.id!r}: {path.name} lacks {missing} (dumped layers {meta.get('layers')})"
                )
            for n in names:
                parts.setdefault(n, []).append(f.get_tensor(n))
        expected_start += parts["input_ids"][-1].shape[0]
    num_tokens = len(sample.input_ids)
    if expected_start != num_tokens:
        raise DumpError(
            f"sample {sample.id!r}: dump covers positions [0, {expected_start}), the sample has {num_tokens}"
        )
    full = {k: torch.cat(v) for k, v in parts.items()}
    if full["input_ids"].tolist() != sample.input_ids:
        raise DumpError(f"sample {sample.id!r}: dumped token ids differ from the sample's input_ids")
    for k, v in full.items():
        if k != "input_ids" and tuple(v.shape) != (num_tokens, hidden_size):
            raise DumpError(
                f"sample {sample.id!r}: {k} has shape {tuple(v.shape)}, expected {(num_tokens, hidden_size)}"
            )
    aux = torch.cat([full[f"hidden.{i}"] for i in aux_layers], dim=-1)
    return aux, full["last_hidden"]


def sglang_rows(
    settings: DriverSettings, aux_layers: list[int], hidden_size: int
) -> Callable[[list[SampleRecord]], Rows]:
    """The SGLang backend: prefill requests in flight, each sample's dump stitched and checked as it returns."""

    def rows(records: list[SampleRecord]) -> Rows:
        used: list[Path] = []
        limits = httpx.Limits(max_connections=settings.concurrency)
        with (
            httpx.Client(base_url=settings.base_url, timeout=settings.request_timeout_s, limits=limits) as client,
            ThreadPoolExecutor(settings.concurrency, thread_name_prefix="prefill") as pool,
        ):
            futures = {pool.submit(prefill, client, r): r for r in records}
            try:
                for fut in as_completed(futures):
                    sample = futures[fut]
                    fut.result()
                    chunks = find_sample_chunks(settings.dump_dir, sample, settings.dump_wait_s)
                    aux, last = assemble_sample(chunks, sample, list(aux_layers), hidden_size)
                    used.extend(p for _, p in chunks)
                    yield sample, aux, last
            finally:
                for f in futures:
                    f.cancel()
        if not settings.keep_dumps:  # only once every sample was handed over; the shard commits next
            for p in used:
                p.unlink(missing_ok=True)

    return rows


def extract_shard_sglang(
    settings: DriverSettings,
    merged_train: Path,
    spec: ShardSpec,
    version_dir: storage.Location | Path,
    *,
    aux_layers: list[int],
    hidden_size: int,
    dtype: str,
    target_identity: str,
    code_version: str = SGLANG_BACKEND_CODE_VERSION,
    progress: Progress | None = None,
    log: Callable[[str], None] = lambda _line: None,
    staging_dir: Path | None = None,
    force: bool = False,
) -> ShardResult:
    """One shard through the server (resume, format, commit and upload to a store are `extract_shard`'s;
    `force`: extract it again even when complete)."""
    fmt = ShardFormat(
        hidden_size=hidden_size,
        dtype=dtype,
        aux_layers=tuple(aux_layers),
        target_identity=target_identity,
        code_version=code_version,
    )
    return extract_shard(
        spec,
        merged_train,
        version_dir,
        fmt,
        sglang_rows(settings, aux_layers, hidden_size),
        progress=progress,
        log=log,
        staging_dir=staging_dir,
        force=force,
    )


def dump_folder(plan: ExtractionPlan) -> Path:
    """The server's `SGLANG_HS_DUMP_DIR` for the plan's version: on the local disk its shards are written to,
    so the chunk files never cross a network. The stage launches the server with it, the driver reads it."""
    if plan.staging_dir is None:  # load_plan and build_plan always name it
        raise ValueError(f"the plan of {plan.version} names no local folder its shards are written in")
    return plan.staging_dir / ".dumps" / plan.version


def main(argv: list[str] | None = None) -> int:
    """`python -m eagle3_dagster.sglang.driver --plan PLAN --shard KEY --base-url URL`: one shard of the plan,
    run on the GPU host beside the dump folder.

    Everything about the shard comes from the plan (extraction_plan's plan.json, on storage the host
    sees): its samples, merged_train, the version folder and staging folder, the aux layers, hidden size, dtype,
    target identity and code version of the shard format, and the dump folder derived from them. Progress and
    the summary go to stdout, which the hidden-states stage streams into the run log."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m eagle3_dagster.sglang.driver")
    p.add_argument("--plan", required=True, help="the plan (plan.json) extraction_plan wrote")
    p.add_argument("--shard", required=True, help="a shard key of the plan, e.g. shard-00003")
    # Not in the plan, so flags: the server is this run's (launched for it, on the port the profile names today,
    # and gone when the run ends); how many requests are in flight changes no byte of a shard, so neither the
    # plan nor the version id carries it; and --force is the run's own choice.
    p.add_argument("--base-url", required=True, help="the server this run launched, as the host sees it")
    p.add_argument("--concurrency", type=int, default=8, help="hidden.sglang_concurrency: prefills in flight")
    p.add_argument("--force", action="store_true", help="extract the shard again even when its manifest says complete")
    a = p.parse_args(argv)
    plan = load_plan(a.plan)
    by_key = {s.key: s for s in plan.shards}
    if a.shard not in by_key:
        print(f"shard {a.shard!r} is not in the plan {a.plan} ({len(by_key)} shards)", file=sys.stderr)
        return 2

    def progress(done: int, total: int) -> None:
        print(f"{a.shard}: {done}/{total} tokens", flush=True)

    fmt = plan.fmt
    result = extract_shard_sglang(
        DriverSettings(a.base_url, dump_folder(plan), concurrency=a.concurrency),
        plan.merged_train,
        by_key[a.shard],
        plan.version_dir,
        aux_layers=list(fmt.aux_layers),
        hidden_size=fmt.hidden_size,
        dtype=fmt.dtype,
        target_identity=fmt.target_identity,
        code_version=fmt.code_version,
        progress=progress,
        log=lambda line: print(line, flush=True),
        staging_dir=plan.staging_dir,
        force=a.force,
    )
    print(
        orjson.dumps(
            {
                "shard": result.key,
                "num_samples": result.num_samples,
                "num_tokens": result.num_tokens,
                "bytes": result.num_bytes,
                "sha256": result.sha256,
                "seconds": result.seconds,
                "skipped": result.skipped,
                "reextracted_corrupt": result.reextracted_corrupt,
                "uploaded_from_staging": result.uploaded_from_staging,
            }
        ).decode(),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
