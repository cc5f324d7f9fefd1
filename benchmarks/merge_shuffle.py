"""Benchmark merged_train's merge + shuffle against GNU `shuf` on a synthetic corpus of the seed's scale.

Scale 1.0 = the seed's corpus: 37,312 records, about 88 M tokens, record lengths
lognormal like real chat data (median ~1.4 k tokens, a long tail past 8 k so
truncation runs), ids over Kimi's 163,840 vocab, split into 4 dataset files.
Targets: merge wall time <= 1.5x `shuf` on the same input, peak RSS <= 64 MB.
Both run as child processes and are measured the same way (wall clock around
the child; its peak RSS from `resource.getrusage(RUSAGE_CHILDREN)` in a fresh
measuring process per command).

    python benchmarks/merge_shuffle.py --scale 0.1 --workdir /tmp/merge_bench
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SEED_RECORDS = 37_312
SEED_TOKENS = 88_000_000
VOCAB = 163_840
DATASETS = ("A1", "A2", "B1", "B2")

# Runs one command as a grandchild and reports its wall time and peak RSS (RUSAGE_CHILDREN of this
# short-lived process holds exactly that one command).
_MEASURE = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
subprocess.run(sys.argv[2:], check=True, stdout=open(sys.argv[1], "wb"))
wall = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""

_MERGE = """
import json, sys
from eagle3_dagster.data.merge import merge_and_shuffle
out, *pairs = sys.argv[1:]
inputs = dict(p.split("=", 1) for p in pairs)
stats = merge_and_shuffle(inputs, out, max_seq_len=8192, seed=42)
print(json.dumps({"records": stats.num_records, "tokens": stats.num_tokens, "truncated": stats.num_truncated,
                  "dropped": stats.num_dropped_by_truncation}))
"""


def make_corpus(workdir: Path, scale: float, seed: int = 0) -> dict[str, Path]:
    """Write the synthetic tokenized_data.jsonl files; lengths lognormal, scaled to the seed's token total."""
    rng = np.random.default_rng(seed)
    n = max(1, int(SEED_RECORDS * scale))
    lengths = rng.lognormal(mean=7.3, sigma=0.9, size=n)
    lengths = np.maximum(8, (lengths * (SEED_TOKENS / SEED_RECORDS) / lengths.mean())).astype(np.int64)
    pool_ids = rng.integers(0, VOCAB, int(lengths.max()) + 1001)
    pool = ",".join(map(str, pool_ids.tolist())).encode()
    commas = np.flatnonzero(np.frombuffer(pool, dtype=np.uint8) == ord(","))
    mask_pool = b"0," * int(lengths.max()) + b"1," * int(lengths.max())
    files = {d: workdir / f"{d}.jsonl" for d in DATASETS}
    handles = {d: open(p, "wb") for d, p in files.items()}
    try:
        for i, length in enumerate(lengths.tolist()):
            d = DATASETS[i % len(DATASETS)]
            start = int(rng.integers(0, 1000)) if length > 1000 else 0
            ids = pool[(commas[start - 1] + 1 if start else 0) : commas[start + length - 1]]
            prompt = int(length * rng.uniform(0.2, 0.8))
            m0 = int(lengths.max()) - prompt
            mask = mask_pool[2 * m0 : 2 * (m0 + length) - 1]
            handles[d].write(
                b'{"id":"%s/%d","dataset":"%s","input_ids":[%s],"loss_mask":[%s],"source":"synthetic"}\n'
                % (d.encode(), i, d.encode(), ids, mask)
            )
    finally:
        for h in handles.values():
            h.close()
    return files


def measure(cmd: list[str], stdout_path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(stdout_path), *cmd], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the seed's corpus (1.0 = 37,312 records)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the corpus goes (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and outputs")
    args = parser.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="merge_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        files = make_corpus(workdir, args.scale)
        corpus_bytes = sum(p.stat().st_size for p in files.values())
        print(f"corpus: {len(files)} files, {corpus_bytes / 1e6:.0f} MB, built in {time.perf_counter() - t:.1f}s")
        # shuf takes one file: give it the same records concatenated (built untimed); this also warms the cache
        with open(workdir / "all.jsonl", "wb") as f:
            for p in files.values():
                f.write(p.read_bytes())
        shuf = measure(["shuf", str(workdir / "all.jsonl")], workdir / "shuf.out")
        # merged_train is durable (fsync before the rename); this baseline pays the same flush
        shuf_sync = measure(
            ["sh", "-c", 'shuf "$0" > "$1" && sync "$1"', str(workdir / "all.jsonl"), str(workdir / "shuf_sync.out")],
            workdir / "shuf_sync.stdout",
        )
        ours = measure(
            [
                sys.executable,
                "-c",
                _MERGE,
                str(workdir / "merged_train.jsonl"),
                *(f"{d}={p}" for d, p in files.items()),
            ],
            workdir / "merge.stdout",
        )
        result = json.loads((workdir / "merge.stdout").read_text())
        wall_ratio = ours["wall_s"] / shuf["wall_s"]
        print(
            f"merge: {result['records']} records, {result['tokens'] / 1e6:.1f} M tokens, "
            f"{result['truncated']} truncated, {result['dropped']} dropped by truncation"
        )
        print()
        print(f"| {'':22} | {'wall s':>8} | {'peak RSS MB':>11} |")
        print(f"|{'-' * 24}|{'-' * 10}|{'-' * 13}|")
        print(f"| {'GNU shuf':22} | {shuf['wall_s']:8.2f} | {shuf['peak_rss_mb']:11.1f} |")
        print(f"| {'GNU shuf + fsync':22} | {shuf_sync['wall_s']:8.2f} | {shuf_sync['peak_rss_mb']:11.1f} |")
        print(f"| {'merge_and_shuffle':22} | {ours['wall_s']:8.2f} | {ours['peak_rss_mb']:11.1f} |")
        print()
        print(f"wall ratio merge/shuf: {wall_ratio:.2f}x (target <= 1.5x) {'OK' if wall_ratio <= 1.5 else 'MISSED'}")
        print(f"wall ratio merge/(shuf + fsync of its output): {ours['wall_s'] / shuf_sync['wall_s']:.2f}x")
        print(
            f"peak RSS: {ours['peak_rss_mb']:.1f} MB = {ours['peak_rss_mb'] / 64:.2f}x the 64 MB bound "
            f"{'OK' if ours['peak_rss_mb'] <= 64 else 'MISSED'}"
        )
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
