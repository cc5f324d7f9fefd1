"""Training reads from an object store: per-sample range reads against a local memory map and against
downloading the shard for each sample.

    python benchmarks/store_reads.py [--hidden-size 256] [--samples-per-shard 32] [--tokens 256] [--reps 5]

One bfloat16 shard is written locally and uploaded to an S3-compatible server on loopback (moto, as
in the tests; no network beyond this machine). Readers, interleaved in every repetition, each over
the first `--measure` samples: `HiddenStatesDataset` on the local folder (mmap, the baseline) and on
the store (header once, then one concurrent set of range GETs per sample), a naive reader that
downloads the whole shard per sample (what range reads avoid). Printed: median and
spread (min-max) of the time per sample, the ratio to the local per-sample baseline, and bytes
moved per sample. Loopback has no network latency, so on a real store each round trip costs more.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch


def write_shard(folder: Path, hidden: int, num_samples: int, tokens: int) -> None:
    from eagle3_dagster.hidden.shards import ShardFormat, ShardWriter

    fmt = ShardFormat(
        hidden_size=hidden, dtype="bfloat16", aux_layers=(2, 3, 4), target_identity="bench", code_version="hf-1"
    )
    ids = [f"b/{i}" for i in range(num_samples)]
    g = torch.Generator().manual_seed(0)
    with ShardWriter(folder, "shard-00000", fmt, ids, [tokens] * num_samples) as w:
        for sid in ids:
            w.write_sample(
                sid,
                input_ids=torch.zeros(tokens, dtype=torch.int64),
                loss_mask=torch.ones(tokens, dtype=torch.uint8),
                aux_hidden=torch.randn(tokens, 3 * hidden, generator=g),
                last_hidden=torch.randn(tokens, hidden, generator=g),
            )


def start_moto_server() -> tuple[subprocess.Popen, str]:
    """`moto_server` on a free loopback port; returns once it answers HTTP."""
    import sys
    import urllib.request

    from eagle3_dagster.ports import free_port

    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            return server, endpoint
        except OSError:
            if server.poll() is not None:
                raise RuntimeError(f"moto_server exited {server.returncode}") from None
            time.sleep(0.1)  # a benchmark's start-up poll, not a test


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--samples-per-shard", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--measure", type=int, default=8, help="samples read per reader and repetition")
    a = p.parse_args()

    # moto in its own process: in this one its request threads would share the readers' GIL
    server, endpoint = start_moto_server()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    from eagle3_dagster import storage
    from eagle3_dagster.hidden.extract import publish_shard
    from eagle3_dagster.hidden.dataset import HiddenStatesDataset

    try:
        storage.filesystem("s3://bench")[0].mkdir("bench")
        with tempfile.TemporaryDirectory() as tmp:
            stage, local = Path(tmp) / "stage", Path(tmp) / "local"
            write_shard(stage, a.hidden_size, a.samples_per_shard, a.tokens)
            local.mkdir()
            for f in stage.iterdir():
                (local / f.name).write_bytes(f.read_bytes())
            url = storage.location("s3://bench/hidden/hs-000000000000")
            publish_shard(stage, url, "shard-00000", log=lambda _line: None)
            shard_bytes = url.join("shard-00000.safetensors").size()

            mapped, remote = HiddenStatesDataset(local), HiddenStatesDataset(url)

            def whole_shard(i: int) -> dict:
                from safetensors.torch import load

                _, start, end, _ = remote._rows[i]
                tensors = load(url.join("shard-00000.safetensors").read_bytes())
                return {k: v[start:end] for k, v in tensors.items() if k != "offsets"}

            readers = {
                "local mmap": mapped.__getitem__,
                "store ranges": remote.__getitem__,
                "store whole shard": whole_shard,
            }
            times: dict[str, list[float]] = {k: [] for k in readers}
            for _ in range(a.reps):
                for name, read in readers.items():  # interleaved: every repetition measures all three
                    start = time.perf_counter()
                    for i in range(a.measure):
                        read(i)
                    times[name].append((time.perf_counter() - start) / a.measure)
    finally:
        server.terminate()
        server.wait()

    base = statistics.median(times["local mmap"])
    per_token = 4 * a.hidden_size * 2 + 9
    print(f"shard {shard_bytes} bytes, {a.samples_per_shard} samples of {a.tokens} tokens, hidden {a.hidden_size}")
    for name, ts in times.items():
        moved = shard_bytes if name == "store whole shard" else a.tokens * per_token
        print(
            f"{name:<18} median {statistics.median(ts) * 1e3:8.2f} ms/sample  (min {min(ts) * 1e3:.2f}, "
            f"max {max(ts) * 1e3:.2f})  ratio {statistics.median(ts) / base:7.2f}  bytes/sample {moved}"
        )


if __name__ == "__main__":
    main()
