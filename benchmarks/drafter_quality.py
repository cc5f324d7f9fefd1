"""Drafter quality by training recipe: several recipes trained on the same shards, measured side by side.

Needs the profile materialized through `extract` (`scripts/demo.sh --until extract`, or the whole
demo). For each recipe variant and seed it trains a drafter through torchrun with the profile's
settings plus the variant's overrides (the worker the asset runs, `python -m eagle3_dagster.train`;
a run already finished is read back, not trained again), then prints one table:

- held-out acc_0 … acc_k and simulated acceptance, measured by the training job on the samples
  `train.eval_fraction` keeps out (chosen by sample-id hash: the same samples for every variant, and
  no variant trains on them);
- acceptance length of the in-process benchmark (the profile's held-out ShareGPT prompts, each spec
  config, by prompt-length band), greedy and sampled at each of `--temperatures` with SGLang's lossless
  rule (default: the profile's `bench.temperatures` and 1, where Kimi-K2.5 thinks);
- optimizer steps, tokens per optimizer step, and training CPU seconds (user + system of the whole
  torchrun process tree, start-up included, so ranks × threads are all counted);
- draft KV bytes per token: what the drafter's KV cache holds per token served, in the export's dtype
  (GQA: K and V of every KV head; MLA, `drafter.attention: mla`: the latent and the shared rotary key).

Variants are run interleaved by seed (every variant at seed 0, then every variant at seed 1, …) so
that a drift in machine load spreads over all of them; the table gives each figure's median over
seeds and its spread (min–max). CPU seconds are only comparable between runs on an otherwise idle
machine.

    python benchmarks/drafter_quality.py [--profile demo] [--variants before,profile] [--seeds 0,1]
        [--json out.json]
    python benchmarks/drafter_quality.py --table-from a.json b.json   # one table of several runs' rows

Run with DAGSTER_HOME unset: nothing here goes through the Dagster instance. Training runs land in
`<run_root>/drafter/run-<hash>/` like the asset's (a variant's run is found again by its hash).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

# Overrides of the profile's `train` section (and, under "drafter", of its `drafter` section). "profile"
# is the profile as it is; the others name what they change, from a plain EAGLE-3 drafter (PLAIN_DRAFTER)
# whatever the profile trains, so a name means the same recipe when the profile's default moves.
PLAIN_DRAFTER = {"attention": "gqa", "fc_norm": False, "norm_output": False}
VARIANTS: dict[str, dict] = {
    "profile": {},
    # the demo's earlier recipe: 2,048 tokens per rank and step, lr 2e-3, 8 epochs, betas (0.9, 0.95)
    "before": {"batch_tokens": 2048, "lr": 2e-3, "epochs": 8, "warmup_ratio": 0.05, "betas": (0.9, 0.95)},
    # the same steps at a higher learning rate: is it the step count or the step size?
    "before_lr8e-3": {"batch_tokens": 2048, "lr": 8e-3, "epochs": 8, "warmup_ratio": 0.05, "betas": (0.9, 0.95)},
    # SpecForge's shape of recipe: one sample per rank and step (batch_tokens below any sample's length)
    "one_sample_4ep": {"batch_tokens": 16, "lr": 2e-3, "epochs": 4, "warmup_ratio": 0.015, "betas": (0.9, 0.999)},
    "one_sample_4ep_lr4e-3": {
        "batch_tokens": 16,
        "lr": 4e-3,
        "epochs": 4,
        "warmup_ratio": 0.015,
        "betas": (0.9, 0.999),
    },
    "one_sample_6ep_lr3e-3": {
        "batch_tokens": 16,
        "lr": 3e-3,
        "epochs": 6,
        "warmup_ratio": 0.015,
        "betas": (0.9, 0.999),
    },
    "one_sample_4ep_lk": {
        "batch_tokens": 16,
        "lr": 2e-3,
        "epochs": 4,
        "warmup_ratio": 0.015,
        "betas": (0.9, 0.999),
        "loss": "lk_lambda",
    },
    "one_sample_6ep": {"batch_tokens": 16, "lr": 2e-3, "epochs": 6, "warmup_ratio": 0.015, "betas": (0.9, 0.999)},
    # the demo's recipe with one change each: the LK lambda objective; Adam's beta2 of the old recipe
    "one_sample_6ep_lk": {
        "batch_tokens": 16,
        "lr": 2e-3,
        "epochs": 6,
        "warmup_ratio": 0.015,
        "betas": (0.9, 0.999),
        "loss": "lk_lambda",
    },
    "one_sample_6ep_b95": {"batch_tokens": 16, "lr": 2e-3, "epochs": 6, "warmup_ratio": 0.015, "betas": (0.9, 0.95)},
    # EAGLE 3.1: a norm on each captured state before fc, and the normed output carried to the next step
    "one_sample_6ep_eagle31": {
        "batch_tokens": 16,
        "lr": 2e-3,
        "epochs": 6,
        "warmup_ratio": 0.015,
        "betas": (0.9, 0.999),
        "drafter": {"fc_norm": True, "norm_output": True},
    },
    # the demo's recipe (EAGLE 3.1) with the old recipe's beta2: betas alone
    "one_sample_6ep_eagle31_b95": {
        "batch_tokens": 16,
        "lr": 2e-3,
        "epochs": 6,
        "warmup_ratio": 0.015,
        "betas": (0.9, 0.95),
        "drafter": {"fc_norm": True, "norm_output": True},
    },
    # the demo's recipe with multi-latent attention (drafter.attention: mla, the dimensions the target's; MLA has
    # no key/value heads of its own), plain EAGLE-3 and EAGLE 3.1: the drafter Kimi's serving recipes ship
    "one_sample_6ep_mla": {
        "batch_tokens": 16,
        "lr": 2e-3,
        "epochs": 6,
        "warmup_ratio": 0.015,
        "betas": (0.9, 0.999),
        "drafter": {"attention": "mla", "num_key_value_heads": None},
    },
    "one_sample_6ep_eagle31_mla": {
        "batch_tokens": 16,
        "lr": 2e-3,
        "epochs": 6,
        "warmup_ratio": 0.015,
        "betas": (0.9, 0.999),
        "drafter": {"attention": "mla", "num_key_value_heads": None, "fc_norm": True, "norm_output": True},
    },
    # the same at a higher learning rate: MLA's low-rank projections and their norms may want larger steps
    "one_sample_6ep_eagle31_mla_lr3e-3": {
        "batch_tokens": 16,
        "lr": 3e-3,
        "epochs": 6,
        "warmup_ratio": 0.015,
        "betas": (0.9, 0.999),
        "drafter": {"attention": "mla", "num_key_value_heads": None, "fc_norm": True, "norm_output": True},
    },
    "one_sample_8ep": {"batch_tokens": 16, "lr": 2e-3, "epochs": 8, "warmup_ratio": 0.015, "betas": (0.9, 0.999)},
    "bt256_4ep": {"batch_tokens": 256, "lr": 3e-3, "epochs": 4, "warmup_ratio": 0.02, "betas": (0.9, 0.999)},
    "bt512_4ep": {"batch_tokens": 512, "lr": 4e-3, "epochs": 4, "warmup_ratio": 0.02, "betas": (0.9, 0.999)},
    "bt512_8ep": {"batch_tokens": 512, "lr": 4e-3, "epochs": 8, "warmup_ratio": 0.02, "betas": (0.9, 0.999)},
    "bt512_4ep_b95": {"batch_tokens": 512, "lr": 4e-3, "epochs": 4, "warmup_ratio": 0.02, "betas": (0.9, 0.95)},
    "bt512_4ep_lr8e-3": {"batch_tokens": 512, "lr": 8e-3, "epochs": 4, "warmup_ratio": 0.02, "betas": (0.9, 0.999)},
    "bt256_8ep": {"batch_tokens": 256, "lr": 3e-3, "epochs": 8, "warmup_ratio": 0.02, "betas": (0.9, 0.999)},
    "bt256_8ep_lr2e-3": {"batch_tokens": 256, "lr": 2e-3, "epochs": 8, "warmup_ratio": 0.02, "betas": (0.9, 0.999)},
    "bt256_8ep_lr5e-3": {"batch_tokens": 256, "lr": 5e-3, "epochs": 8, "warmup_ratio": 0.02, "betas": (0.9, 0.999)},
    "bt128_8ep": {"batch_tokens": 128, "lr": 2e-3, "epochs": 8, "warmup_ratio": 0.02, "betas": (0.9, 0.999)},
    "bt1024_8ep": {"batch_tokens": 1024, "lr": 6e-3, "epochs": 8, "warmup_ratio": 0.02, "betas": (0.9, 0.999)},
}


def variant_profile(base, overrides: dict, seed: int):
    overrides = dict(overrides)
    named = bool(overrides)  # "profile" ({}) keeps the profile's drafter
    drafter = base.drafter.model_copy(update={**(PLAIN_DRAFTER if named else {}), **overrides.pop("drafter", {})})
    train = base.train.model_copy(update={**overrides, "seed": seed})
    return base.model_copy(
        update={
            "train": type(base.train).model_validate(train.model_dump()),
            "drafter": type(base.drafter).model_validate(drafter.model_dump()),
        }
    )


def train_variant(profile, layout, plan_path, log) -> dict:
    """Train (or read back) one variant; returns metrics.json plus the CPU seconds of its torchrun tree."""
    from eagle3_dagster.io import atomic_write_json
    from eagle3_dagster.storage import read_json
    from eagle3_dagster.stages.train import TrainSettings, prepare_training
    from eagle3_dagster.train import build_torchrun_command

    job = prepare_training(TrainSettings.from_profile(profile), layout, plan_path=plan_path)
    cost_path = job.out_dir / "quality_bench_cost.json"
    if (job.out_dir / "metrics.json").exists() and cost_path.exists():
        log(f"    reusing {job.out_dir}")
        return read_json(job.out_dir / "metrics.json") | read_json(cost_path) | {"run_dir": str(job.out_dir)}
    command = build_torchrun_command(job.job_path, nproc_per_node=profile.train.nproc_per_node, python=sys.executable)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    subprocess.run(
        command,
        env={**os.environ, **job.env},
        cwd=job.cwd,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    cost = {"train_cpu_s": round(cpu, 1), "train_wall_s": round(wall, 1), "load_avg_1m": os.getloadavg()[0]}
    atomic_write_json(cost_path, cost)
    return read_json(job.out_dir / "metrics.json") | cost | {"run_dir": str(job.out_dir)}


class Acceptance:
    """The in-process benchmark of the asset, restricted to the trained drafter (one untimed round), greedy
    and sampled at each of `temperatures` (SGLang's lossless rule, coins seeded per prompt)."""

    def __init__(self, profile, layout, num_prompts: int | None, temperatures: list[float]) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from eagle3_dagster.bench.prompts import heldout_sharegpt, render_prompts
        from eagle3_dagster.bench.report import LengthBands
        from eagle3_dagster.bench.served import prompt_token_limit
        from eagle3_dagster.target import target_facts

        target = target_facts(profile, layout)
        tokenizer = AutoTokenizer.from_pretrained(target.path)
        self.target_path = target.path
        self.model = AutoModelForCausalLM.from_pretrained(target.path, dtype=torch.float32).eval()
        bench = profile.bench
        limit = prompt_token_limit(profile.target.serving_context, bench.max_new_tokens, bench.max_prompt_tokens)
        prompts = heldout_sharegpt(num_prompts or bench.num_prompts, profile.data.heldout_fraction)
        self.sets = {"heldout_sharegpt": render_prompts(tokenizer, prompts, limit)}
        self.bands = LengthBands.for_training(profile.data.max_seq_len, profile.target.serving_context)
        self.eos = {i for i in [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id] if i is not None}
        self.specs, self.max_new_tokens = bench.spec_configs, bench.max_new_tokens
        self.temperatures = list(dict.fromkeys(float(t) for t in temperatures))

    def measure_once(self, run_dir: Path) -> dict[str, dict[str, float]]:
        """`measure` of the run's export, kept beside it per temperature (outputs are deterministic: greedy,
        or sampled with seeded coins), so a rerun of the table decodes only temperatures not yet measured."""
        from eagle3_dagster.io import atomic_write_json
        from eagle3_dagster.storage import read_json

        key = {
            "prompts": {n: [pid for pid, _ in p] for n, p in self.sets.items()},
            "specs": list(map(list, self.specs)),
            "max_new_tokens": self.max_new_tokens,
        }
        path = run_dir / "quality_bench_acceptance.json"
        cached = read_json(path) if path.exists() else {}
        by_t = cached.get("by_temperature", {}) if cached.get("key") == key else {}
        if not by_t and cached.get("key") == key and "acceptance" in cached:  # written before temperatures
            by_t = {"0": cached["acceptance"]}
        missing = [t for t in self.temperatures if f"{t:g}" not in by_t]
        if missing:
            by_t |= {f"{t:g}": acc for t, acc in self.measure(run_dir / "export", missing).items()}
            atomic_write_json(path, {"key": key, "by_temperature": by_t})
        out: dict[str, dict[str, float]] = {}
        for t in self.temperatures:
            for spec, bands in by_t[f"{t:g}"].items():
                out[spec if not t else f"{spec} T{t:g}"] = bands
        return out

    def measure(self, export_dir: Path, temperatures: list[float]) -> dict[float, dict[str, dict[str, float]]]:
        """{temperature: {spec label: {band label or 'all': acceptance length}}}."""
        import torch

        from eagle3_dagster.bench.proposers import Eagle3Proposer
        from eagle3_dagster.bench.specdec import SpecConfig, run_inprocess_benchmark
        from eagle3_dagster.drafter.imported import load_drafter

        drafter = load_drafter(export_dir, self.target_path).float()
        with torch.inference_mode():
            rows = run_inprocess_benchmark(
                self.model,
                self.sets,
                {"eagle3": Eagle3Proposer(drafter, name="eagle3")},
                [SpecConfig.parse(tuple(c)) for c in self.specs],
                self.max_new_tokens,
                eos_ids=self.eos,
                check=True,
                rounds=1,
                bands=self.bands,
                temperatures=temperatures,
            )
        out: dict[float, dict[str, dict[str, float]]] = {t: {} for t in temperatures}
        for row in rows:
            if row["method"] != "eagle3":
                continue
            out[row["temperature"]][row["spec"]] = {"all": row["acceptance_length"]} | {
                b["band"]: b["acceptance_length"] for b in row.get("bands", []) if b.get("acceptance_length")
            }
        return out


def _spread(values: list[float], digits: int) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def table(rows: list[dict], ttt_steps: int) -> str:
    names = list(dict.fromkeys(r["variant"] for r in rows))
    specs = list(dict.fromkeys(s for r in rows for s in r["acceptance"]))
    bands = list(dict.fromkeys(b for r in rows for s in r["acceptance"].values() for b in s))
    head = (
        ["variant", "seeds", "steps", "tokens/step"]
        + [f"acc_{j}" for j in range(ttt_steps)]
        + ["sim. acceptance"]
        + [f"accept {s} {b}" for s in specs for b in bands]
        + ["train CPU s"]
        + ["draft KV B/token"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        group = [r for r in rows if r["variant"] == name]
        cells = [
            name,
            ",".join(str(r["seed"]) for r in group),
            _spread([r["steps"] for r in group], 0),
            _spread([r["tokens_per_step"] for r in group], 0),
        ]
        cells += [_spread([r["heldout"][f"acc_{j}"] for r in group], 3) for j in range(ttt_steps)]
        cells.append(_spread([r["heldout"]["sim_accept_length"] for r in group], 3))
        cells += [_spread([r["acceptance"].get(s, {}).get(b) for r in group], 3) for s in specs for b in bands]
        cells.append(_spread([r["train_cpu_s"] for r in group], 0))
        cells.append(_spread([r.get("draft_kv_bytes_per_token") for r in group], 0))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decoding(temperatures: list[float]) -> str:
    sampled = ", ".join(f"{t:g}" for t in temperatures if t)
    greedy = "greedy" if 0.0 in temperatures else ""
    return " and ".join(filter(None, [greedy, sampled and f"sampled at T = {sampled} (columns 'T…')"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="demo")
    parser.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated, from {sorted(VARIANTS)} (default: before,profile; with --table-from: all)",
    )
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--num-prompts", type=int, default=None, help="benchmark prompts (default: the profile's)")
    parser.add_argument(
        "--temperatures",
        default=None,
        help="comma-separated decoding temperatures of the acceptance benchmark, 0 = greedy "
        "(default: the profile's bench.temperatures and 1, the temperature Kimi-K2.5 thinks at)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--table-from",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="print the table of rows earlier runs wrote with --json (no training, no decoding)",
    )
    args = parser.parse_args()
    if args.table_from:
        rows = [r for path in args.table_from for r in json.loads(path.read_text())]
        if args.variants:
            keep = args.variants.split(",")
            rows = sorted(
                (r for r in rows if r["variant"] in keep), key=lambda r: (keep.index(r["variant"]), r["seed"])
            )
        print(table(rows, len([k for k in rows[0]["heldout"] if k.startswith("acc_")])))
        return

    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import ArtifactLayout
    from eagle3_dagster.hidden.extraction_plan import build_plan, write_plan
    from eagle3_dagster.stages.hidden import PlanSettings, draft_kv_cache

    base = load_profile(args.profile)
    layout = ArtifactLayout.from_profile(base)
    plan_path = write_plan(build_plan(base, layout))
    from benchmarks import specforge_variant

    # "specforge": SpecForge's own trainer on the same shards and recipe (benchmarks/specforge_variant.py)
    known = {**VARIANTS, specforge_variant.NAME: specforge_variant.OVERRIDES}
    names = [v for v in (args.variants or "before,profile").split(",") if v]
    unknown = [v for v in names if v not in known]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {sorted(known)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    temperatures = (
        [float(t) for t in args.temperatures.split(",")] if args.temperatures else [*base.bench.temperatures, 1.0]
    )
    acceptance = Acceptance(base, layout, args.num_prompts, temperatures)
    rows = []
    for seed in seeds:
        for name in names:
            profile = variant_profile(base, known[name], seed)
            print(f"==> {name} seed {seed}: {json.dumps(known[name])}", flush=True)
            train = specforge_variant.train_specforge if name == specforge_variant.NAME else train_variant
            m = train(profile, layout, plan_path, lambda line: print(line, flush=True))
            kv = draft_kv_cache(PlanSettings.from_profile(profile), acceptance.target_path)
            heldout = m["final_eval"]
            if heldout.get("scope") != "heldout":
                raise SystemExit(f"{name}: the training job measured no held-out samples (train.eval_fraction is 0)")
            acc = acceptance.measure_once(Path(m["run_dir"]))
            steps = m["steps"]
            rows.append(
                {
                    "variant": name,
                    "seed": seed,
                    "overrides": known[name],
                    "steps": steps,
                    "tokens_per_step": m["tokens_seen"] / max(steps, 1),
                    "heldout": heldout,
                    "acceptance": acc,
                    "train_cpu_s": m["train_cpu_s"],
                    "train_wall_s": m["train_wall_s"],
                    "load_avg_1m": m.get("load_avg_1m"),
                    "run_dir": m["run_dir"],
                    "draft_attention": kv["draft_attention"],
                    "draft_kv_bytes_per_token": kv["draft_kv_bytes_per_token"],
                }
            )
            print(
                f"    {steps} steps, held-out acc_0 {heldout['acc_0']:.3f} sim {heldout['sim_accept_length']:.3f}, "
                f"acceptance {json.dumps(acc)}, {m['train_cpu_s']} CPU s",
                flush=True,
            )
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
    held = rows[0]["heldout"]
    print(
        f"\nprofile {args.profile}: held-out {held.get('num_samples')} samples, {held.get('num_scored_tokens')} "
        f"scored tokens; benchmark: {sum(len(p) for p in acceptance.sets.values())} held-out prompts, "
        f"{decoding(acceptance.temperatures)}, {acceptance.max_new_tokens} new tokens; median (min–max) over seeds "
        f"{seeds}\n"
    )
    print(table(rows, base.train.ttt_steps))


if __name__ == "__main__":
    main()
