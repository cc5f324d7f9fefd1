"""The extraction plan of a profile for a corpus of a given size, without the corpus: bytes and hours.

`eagle3 plan` needs the profile's merged_train; this runs the same estimate function
(`hidden.estimate.estimate_extraction`: exact shard and manifest bytes, hours on 1, 2, 4
and the profile's hosts in whole shards) on samples of equal length adding up
to `--tokens`, at the profile's hidden size, layers, shard size and throughput,
in bf16 and fp8, and the training schedule the profile's `train` makes of them
(optimizer steps, tokens per step: what `eagle3 plan` prints for a real corpus). The production figures in docs/production.md come from:

    .venv/bin/python scripts/production_plan.py --profile production --tokens 87800000 --samples 21436
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3_dagster.config import load_profile
from eagle3_dagster.hidden.estimate import TIB, estimate_extraction
from eagle3_dagster.hidden.sharding import ShardSpec, shard_key
from eagle3_dagster.hidden.shards import ShardFormat
from eagle3_dagster.train.schedule import train_schedule


def equal_shards(num_tokens: int, num_samples: int, per_shard: int) -> list[ShardSpec]:
    lengths = [num_tokens // num_samples] * num_samples
    lengths[-1] += num_tokens - sum(lengths)
    specs = []
    for index, first in enumerate(range(0, num_samples, per_shard)):
        chunk = lengths[first : first + per_shard]
        specs.append(
            ShardSpec(
                key=shard_key(index),
                index=index,
                first_record=first,
                num_records=len(chunk),
                num_tokens=sum(chunk),
                byte_offset=0,
                lengths=tuple(chunk),
                sample_ids=tuple(f"sample/{first + j}" for j in range(len(chunk))),
            )
        )
    return specs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="production")
    parser.add_argument("--tokens", type=int, required=True, help="tokens in merged_train")
    parser.add_argument("--samples", type=int, required=True, help="samples in merged_train")
    parser.add_argument("--hidden-size", type=int, default=7168, help="the target's (Kimi-K2.5: 7168)")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    h = profile.hidden
    specs = equal_shards(args.tokens, args.samples, h.samples_per_shard)
    aux = tuple(h.aux_layers or (2, 30, 58))
    print(
        f"{args.profile}: {args.tokens:,} tokens in {args.samples:,} samples, {len(specs)} shards of "
        f"{h.samples_per_shard}, {h.throughput_tokens_per_s:g} tokens/s per host, "
        f"{len(profile.gpu_host.hosts)} host(s) in the profile"
    )
    for dtype in ("bfloat16", "float8_e4m3fn"):
        fmt = ShardFormat(
            hidden_size=args.hidden_size, dtype=dtype, aux_layers=aux, target_identity="planned", code_version="planned"
        )
        estimate = estimate_extraction(
            specs,
            fmt,
            "/nonexistent",
            "hs-000000000000",
            free_bytes=0,
            throughput_tokens_per_s=h.throughput_tokens_per_s,
            num_hosts=len(profile.gpu_host.hosts),
        )
        hours = "  ".join(f"{n} host{'s' * (n > 1)}: {x:.1f} h" for n, x in estimate.hours_by_hosts.items())
        print(f"{dtype:<14} {estimate.total_bytes:,} bytes = {estimate.total_bytes / TIB:.2f} TiB   {hours}")
    world = profile.train.nproc_per_node * profile.train.nnodes
    lengths = [n for s in specs for n in s.lengths]
    ids = [sid for s in specs for sid in s.sample_ids]
    print("training: " + train_schedule(lengths, ids, profile.train, world).describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
