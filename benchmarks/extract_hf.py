"""Extraction overhead of the hf backend: wall time of extract vs a bare forward over the same batches.

    python benchmarks/extract_hf.py [--model-dir DIR] [--num-samples 256] [--batch-tokens 4096]

Without --model-dir a randomly initialised DeepSeek-V3 of the demo's size
(configs/demo.yaml target.tiny: hidden 128, 8 layers, vocab 4096) is built; the
weights do not matter for timing. Both sides run the same length-bucketed padded
batches under inference_mode with the same loaded decoder; the extraction side
adds the aux hooks, the background writer, fsync, sha256 and manifests. The
target is a ratio of at most 1.10.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from eagle3_dagster.hidden.extract_hf import extract_shard_hf, length_buckets, load_target_hf, pad_batch
from eagle3_dagster.hidden.estimate import actual_bytes
from eagle3_dagster.hidden.sharding import plan_shards, read_shard_records
from eagle3_dagster.io import write_jsonl
from eagle3_dagster.layers import default_aux_layers


def build_demo_size_target(out: Path) -> Path:
    from eagle3_dagster.config import load_profile
    from eagle3_dagster.tiny.model import create_tiny_model, tiny_model_config

    tiny = load_profile("demo").target.tiny
    config = tiny_model_config(tiny, vocab_size=tiny.vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    create_tiny_model(config, seed=0).save_pretrained(out)
    return out


def write_merged_train(path: Path, num_samples: int, min_len: int, max_len: int, vocab: int, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num_samples,), generator=g).tolist()
    write_jsonl(
        path,
        (
            {
                "id": f"bench/{i}",
                "dataset": "bench",
                "input_ids": torch.randint(0, vocab, (n,), generator=g).tolist(),
                "loss_mask": [1] * n,
            }
            for i, n in enumerate(lengths)
        ),
    )
    return path


@torch.inference_mode()
def forward_only(model, batches: list[list], device) -> float:
    start = time.perf_counter()
    for batch in batches:
        ids, mask = pad_batch(batch)
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        out.last_hidden_state.cpu()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--num-samples", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--samples-per-shard", type=int, default=64)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=3, help="best of N for each side")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = args.model_dir or build_demo_size_target(tmp / "target")
        model = load_target_hf(model_dir, args.dtype, args.device)
        device = next(model.parameters()).device
        aux = default_aux_layers(model.config.num_hidden_layers)
        merged = write_merged_train(
            tmp / "merged_train.jsonl", args.num_samples, args.min_len, args.max_len, model.config.vocab_size, seed=0
        )
        specs = plan_shards(merged, args.samples_per_shard)
        tokens = sum(s.num_tokens for s in specs)
        batches = [b for s in specs for b in length_buckets(read_shard_records(merged, s), args.batch_tokens)]
        forward_only(model, batches[:1], device)  # warm-up

        fwd, ext, written = [], [], 0
        for rep in range(args.repeats):
            fwd.append(forward_only(model, batches, device))
            version_dir = tmp / f"hs-{rep:012d}"
            start = time.perf_counter()
            for spec in specs:
                extract_shard_hf(
                    model_dir,
                    merged,
                    spec,
                    version_dir,
                    aux_layers=aux,
                    dtype=args.dtype,
                    batch_tokens=args.batch_tokens,
                    target_identity="bench",
                    model=model,
                )
            ext.append(time.perf_counter() - start)
            written = actual_bytes(version_dir, [s.key for s in specs])

        f, e = min(fwd), min(ext)
        print(
            f"target: {model_dir} ({model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}), "
            f"device {device}, dtype {args.dtype}, threads {torch.get_num_threads()}"
        )
        print(
            f"data: {args.num_samples} samples, {tokens} tokens, {len(specs)} shards, {len(batches)} batches "
            f"of <= {args.batch_tokens} padded tokens; aux layers {aux}"
        )
        print(f"forward only : {f:8.3f} s  ({tokens / f:,.0f} tok/s)   runs {[round(x, 3) for x in fwd]}")
        print(f"extraction   : {e:8.3f} s  ({tokens / e:,.0f} tok/s)   runs {[round(x, 3) for x in ext]}")
        print(f"written      : {written / 2**20:.1f} MiB")
        print(f"ratio extraction / forward = {e / f:.3f}  (target <= 1.10)")


if __name__ == "__main__":
    main()
