"""Peak memory of one TTT forward+backward at 2k, 4k and 8k tokens on CPU.

Each length runs in a fresh subprocess (torch's allocator never returns memory,
and tracemalloc does not see it); the figure is the peak resident set
(`VmHWM`) minus the resident set just before the forward. Linear memory shows
as ~2× per doubling of the length; a dense L×(L+k) mask or score matrix per
head would show ~4×.

    OMP_NUM_THREADS=1 python benchmarks/ttt_memory.py [--steps 3] [--lengths 2048 4096 8192]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(length: int, steps: int) -> dict:
    import torch

    from eagle3_dagster.drafter.loss import build_teacher, ttt_loss
    from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_dagster.drafter.ttt import ttt_unroll

    torch.manual_seed(0)
    vocab, draft_vocab, h = 2048, 1024, 128
    cfg = DrafterConfig(
        target_hidden_size=h,
        hidden_size=h,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layers=(1, 2, 3),
    )
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    model = Eagle3Drafter(cfg, torch.randn(vocab, h), torch.zeros(draft_vocab, dtype=torch.long), t2d)
    ids = torch.randint(0, vocab, (1, length))
    aux, last = torch.randn(1, length, 3 * h), torch.randn(1, length, h)
    teacher = build_teacher(last, torch.ones(1, length, dtype=torch.long), torch.randn(vocab, h), t2d)
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    total, _ = ttt_loss(list(ttt_unroll(model, ids, aux, steps)), model.lm_head.weight, teacher)
    total.backward()
    return {
        "tokens": length,
        "steps": steps,
        "peak_delta_mib": (_status_kib("VmHWM") - before) / 1024,
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child mode: measure one length
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.steps)))
        return
    rows = []
    for n in args.lengths:
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(n), "--steps", str(args.steps)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'tokens':>7} {'peak MiB':>9} {'growth':>7} {'seconds':>8}")
    for prev, row in zip([None, *rows], rows):
        growth = f"{row['peak_delta_mib'] / prev['peak_delta_mib']:.2f}x" if prev else "-"
        print(f"{row['tokens']:>7} {row['peak_delta_mib']:>9.1f} {growth:>7} {row['seconds']:>8.1f}")


if __name__ == "__main__":
    main()
