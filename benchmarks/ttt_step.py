"""One full TTT training step (forward, backward, clip, AdamW) on CPU: tokens/s and peak RSS, new vs baseline.

Shapes are SpecForge's CPU-runnable ones: drafter hidden 256, 4
heads, intermediate 512, target hidden 256, TTT 7, batch 1, fp32, 2 threads;
vocabularies (target, draft) = (8192, 2048) and (128000, 32000). The baseline
is the objective before the fused teacher pass, kept in `benchmarks/ttt_baseline.py`.

Every measurement is a fresh subprocess (torch's allocator never returns
memory, so a peak is only a peak per process): it builds the model, runs one
warm-up step (below 4k tokens) and times the next max(1, 2048 // tokens)
steps; the figure is their median tokens/s and the process's peak resident set
(`VmHWM`, absolute: it includes torch itself).
Rounds interleave the implementations (the order flips every round) so load
from other processes on a shared machine hits both alike; the table gives the
median over rounds and the spread (min–max). Baseline runs whose projected
memory would not fit are skipped and marked so.

    python benchmarks/ttt_step.py [--rounds 3] [--lengths 512 1024 2048 4096 8192] \
        [--vocabs 8192:2048 128000:32000] [--baseline-max-tokens 128000:32000=2048]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "benchmarks"))

IMPLS = ("baseline", "new")
TIMED_TOKENS = 2048  # a child times max(1, TIMED_TOKENS // length) steps after its warm-up step
# From this length on a child times its first step (no warm-up: a step there is 10-100 s on 2 busy
# cores); first-touch page faults then count for both implementations alike.
NO_WARMUP_FROM = 4096


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


def measure(impl: str, length: int, vocab: int, draft_vocab: int, threads: int, ttt_steps: int = 7) -> dict:
    import torch

    from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    h = 256
    cfg = DrafterConfig(
        target_hidden_size=h,
        hidden_size=h,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layers=(1, 2, 3),
    )
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab)[:draft_vocab]] = True
    d2t = t2d.nonzero().squeeze(-1) - torch.arange(draft_vocab)
    drafter = Eagle3Drafter(cfg, torch.randn(vocab, h) * 0.02, d2t, t2d)
    lm_head = torch.randn(vocab, h) * 0.05
    # Every row supervised and the target's argmax inside the draft vocab (its rows dominate): every
    # row is valid, the worst case for the new objective, which skips rows that teach nothing.
    lm_head[t2d] *= 3
    ids = torch.randint(0, vocab, (1, length))
    mask = torch.ones(1, length, dtype=torch.long)
    aux, last = torch.randn(1, length, 3 * h), torch.randn(1, length, h)
    if impl == "baseline":
        import ttt_baseline

        def loss_fn():
            return ttt_baseline.objective(drafter, lm_head, ttt_steps, ids, mask, aux, last)[0]
    else:
        from eagle3_dagster.train.loop import TTTObjective, tune_cpu_allocator

        if impl == "new":  # what Trainer does on CPU; "new_default_malloc" leaves glibc as it is
            tune_cpu_allocator(length)
        objective = TTTObjective(drafter, lm_head, ttt_steps)

        def loss_fn():
            return objective(ids, mask, aux, last)[0]

    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        return float(loss.detach())

    if length < NO_WARMUP_FROM:
        step()  # warm-up: first-touch page faults and kernel selection
    times = []
    for _ in range(max(1, TIMED_TOKENS // length)):  # short sequences: median of a few steps
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    return {
        "impl": impl,
        "tokens": length,
        "vocab": vocab,
        "draft_vocab": draft_vocab,
        "seconds": seconds,
        "tokens_per_s": length / seconds,
        "peak_rss_mib": _peak_rss_mib(),
        "loss": loss,
        "valid_rows": valid_fraction(lm_head, last, t2d),
    }


def valid_fraction(lm_head, last, t2d) -> float:
    return float(t2d[(last[0] @ lm_head.T).argmax(-1)].float().mean())


def _run_child(impl: str, length: int, vocab: int, draft_vocab: int, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    proc = subprocess.run(
        [sys.executable, __file__, "--one", impl, str(length), str(vocab), str(draft_vocab), "--threads", str(threads)],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        return {"impl": impl, "tokens": length, "error": f"exit {proc.returncode} {last}".strip()}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _spread(values: list[float], digits: int = 0) -> str:
    med = statistics.median(values)
    return (
        f"{med:,.{digits}f} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"
        if len(values) > 1
        else f"{med:,.{digits}f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--vocabs", nargs="+", default=["8192:2048", "128000:32000"], help="target:draft")
    parser.add_argument(
        "--baseline-max-tokens",
        nargs="*",
        default=["128000:32000=2048"],
        help="target:draft=N: skip the baseline above N tokens (it needs ~6.5 GB at 2k, 24+ GB at 8k)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--impls",
        nargs="+",
        default=list(IMPLS),
        help="baseline, new, new_default_malloc (new without Trainer's glibc setting)",
    )
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # child: impl length vocab draft_vocab
    args = parser.parse_args()
    if args.one:
        impl, length, vocab, draft_vocab = args.one[0], *map(int, args.one[1:])
        print(json.dumps(measure(impl, length, vocab, draft_vocab, args.threads)))
        return
    vocabs = [tuple(int(x) for x in v.split(":")) for v in args.vocabs]
    caps = {tuple(int(x) for x in k.split(":")): int(n) for k, n in (c.split("=") for c in args.baseline_max_tokens)}
    results: list[dict] = []
    for r in range(args.rounds):
        order = args.impls if r % 2 == 0 else args.impls[::-1]
        for vocab, draft in vocabs:
            for n in args.lengths:
                for impl in order:
                    if impl == "baseline" and n > caps.get((vocab, draft), 1 << 30):
                        continue
                    row = _run_child(impl, n, vocab, draft, args.threads) | {
                        "round": r,
                        "vocab": vocab,
                        "draft_vocab": draft,
                    }
                    results.append(row)
                    print(
                        f"# round {r} {impl:8} V={vocab}/{draft} {n:>5} tokens: "
                        + (
                            f"{row['tokens_per_s']:.1f} tok/s, peak {row['peak_rss_mib']:.0f} MiB"
                            if "error" not in row
                            else f"failed: {row['error']}"
                        ),
                        file=sys.stderr,
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    impls = args.impls
    others = [i for i in impls if i != "baseline"]
    print(
        f"rounds {args.rounds}, {args.threads} threads, median (min–max) over rounds; peak = process VmHWM; "
        "speed ratio = per-round tok/s over the baseline's of the same round\n"
    )
    print(
        "| target/draft vocab | tokens | "
        + " | ".join(f"{i} tok/s" for i in impls)
        + " | "
        + " | ".join(f"{i} / baseline" for i in others)
        + " | "
        + " | ".join(f"{i} peak MiB" for i in impls)
        + " |"
    )
    print("|---|---:" + "|---:" * (2 * len(impls) + len(others)) + "|")
    for vocab, draft in vocabs:
        for n in args.lengths:
            got = {
                impl: [
                    x
                    for x in results
                    if x["impl"] == impl
                    and x["tokens"] == n
                    and x["vocab"] == vocab
                    and x["draft_vocab"] == draft
                    and "error" not in x
                ]
                for impl in impls
            }
            speed = [_spread([x["tokens_per_s"] for x in got[i]], 1) if got[i] else "not run" for i in impls]
            peak = [_spread([x["peak_rss_mib"] for x in got[i]]) if got[i] else "–" for i in impls]
            ratios = []
            for impl in others:
                pairs = [
                    a["tokens_per_s"] / b["tokens_per_s"]
                    for a in got[impl]
                    for b in got.get("baseline", [])
                    if a["round"] == b["round"]
                ]
                ratios.append(_spread(pairs, 2) + "×" if pairs else "–")
            print(f"| {vocab:,}/{draft:,} | {n:,} | " + " | ".join(speed + ratios + peak) + " |")


if __name__ == "__main__":
    main()
