"""CPU-seconds per pre-training step of the demo's tiny target, alone and beside a competing load.

Observed: with a load average near 10 on 2 cores, pre-training cost 4.05 CPU-seconds per step against
0.84 quiet; the CPU share explains a slower wall clock, not more CPU per step. Extra CPU per step is
torch's OpenMP pool waiting for its threads: libgomp spins at each parallel region's barrier while the
thread it waits for is not running. This script measures that, per thread policy:

- `default`: what torch does by itself (its intra-op pool sized from the CPUs, OpenMP's default waiting);
- `stage`: what the target's pre-training applies (`eagle3_dagster.threads.stage_threads(load_aware=True)`):
  the cores this process really gets (affinity mask, cgroup CPU quota) less those other runnable threads
  of its priority want at its start;
- `passive`: torch's own thread count with `OMP_WAIT_POLICY=PASSIVE` (waiting threads sleep, no spinning);
- `one`: a single thread, the floor (no barrier to wait at).

Each measurement is a fresh subprocess (OpenMP reads its environment once, when torch loads). It builds
the demo profile's tiny target, runs `--warmup` steps and times `--steps` more (forward, backward, clip,
AdamW on a `pretrain_batch_size` x `pretrain_seq_len` batch, as `eagle3_dagster.tiny.pretrain` does);
the figures are the child's CPU seconds (user + system, `os.times`) and wall seconds per timed step.
"loaded" runs it beside `--load` busy processes (pure-Python loops at the same priority) started before
the child and stopped after it. Rounds interleave policies and conditions (the order flips every round);
the table gives the median over rounds and the spread (min–max), and each policy's figure over
`default`'s in the same condition.

    python benchmarks/threads_under_load.py [--rounds 3] [--steps 8] [--load 8] [--policies default,stage,passive,one]
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

POLICIES = ("default", "stage", "passive", "one")
CONDITIONS = ("alone", "loaded")
BUSY = "import os\nos.nice(0)\nwhile True:\n    pass\n"


def child(policy: str, steps: int, warmup: int) -> dict:
    """One measurement, in this (fresh) process: thread settings first, then torch."""
    if policy == "stage":
        from eagle3_dagster.threads import stage_threads

        stage_threads(load_aware=True)
    import torch

    if policy == "one":
        torch.set_num_threads(1)
    threads = torch.get_num_threads()
    from eagle3_dagster.config import load_profile
    from eagle3_dagster.tiny.model import create_tiny_model, tiny_model_config

    cfg = load_profile("demo").target.tiny
    config = tiny_model_config(cfg, vocab_size=cfg.vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = create_tiny_model(config, cfg.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    batch_BT = torch.randint(
        0, cfg.vocab_size, (cfg.pretrain_batch_size, cfg.pretrain_seq_len), generator=torch.Generator().manual_seed(0)
    )

    def step() -> None:
        loss = model(input_ids=batch_BT, labels=batch_BT).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    t0, c0 = time.monotonic(), os.times()
    for _ in range(steps):
        step()
    t1, c1 = time.monotonic(), os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    return {
        "policy": policy,
        "threads": threads,
        "cpu_s_per_step": cpu / steps,
        "wall_s_per_step": (t1 - t0) / steps,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }


def measure(policy: str, condition: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    for key in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS"):
        env.pop(key, None)  # each policy starts from a bare environment
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"  # libgomp reads it once, when torch loads
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.load if condition == "loaded" else 0)]
    try:
        if busy:
            time.sleep(1.0)  # the busy loops are running before the child starts
        out = subprocess.run(
            [sys.executable, __file__, "--child", policy, "--steps", str(args.steps), "--warmup", str(args.warmup)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.wait()
    if out.returncode != 0:
        raise SystemExit(f"child {policy}/{condition} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "condition": condition}


def spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def table(rows: list[dict], policies: list[str]) -> str:
    lines = [
        "| policy | threads | condition | CPU s / step | wall s / step | CPU s / step ÷ default's | "
        "CPU s / step loaded ÷ alone |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    by = {(r["policy"], r["condition"]): [] for r in rows}
    for r in rows:
        by[(r["policy"], r["condition"])].append(r)
    rounds = max(r["round"] for r in rows) + 1

    def ratios(num: tuple, den: tuple) -> list[float]:
        """Per-round ratios: round k's figures were measured next to each other."""
        a = {r["round"]: r["cpu_s_per_step"] for r in by.get(num, [])}
        b = {r["round"]: r["cpu_s_per_step"] for r in by.get(den, [])}
        return [a[k] / b[k] for k in range(rounds) if k in a and k in b]

    for policy in policies:
        for condition in CONDITIONS:
            got = by.get((policy, condition), [])
            if not got:
                continue
            vs_default = ratios((policy, condition), ("default", condition))
            vs_alone = ratios((policy, "loaded"), (policy, "alone")) if condition == "loaded" else []
            lines.append(
                f"| {policy} | {got[0]['threads']} | {condition} | {spread([r['cpu_s_per_step'] for r in got], '.3f')} | "
                f"{spread([r['wall_s_per_step'] for r in got], '.3f')} | "
                f"{spread(vs_default, '.2f') + '×' if policy != 'default' and vs_default else '–'} | "
                f"{spread(vs_alone, '.2f') + '×' if vs_alone else '–'} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--load", type=int, default=8, help="busy processes beside the 'loaded' runs")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", help="also write every measurement here")
    parser.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.warmup)))
        return
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; known: {list(POLICIES)}")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    rows = []
    for k in range(args.rounds):
        order = [(p, c) for c in CONDITIONS for p in policies]
        for policy, condition in order if k % 2 == 0 else order[::-1]:
            row = {**measure(policy, condition, args), "round": k}
            rows.append(row)
            print(
                f"round {k} {policy:8s} {condition:6s} threads {row['threads']} "
                f"cpu {row['cpu_s_per_step']:.3f} s/step wall {row['wall_s_per_step']:.3f} s/step",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(table(rows, policies))


if __name__ == "__main__":
    main()
