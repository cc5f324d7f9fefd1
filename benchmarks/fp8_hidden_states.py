"""fp8 against full-precision hidden states: one corpus, two drafters, measured in one run.

Needs the profile materialized through `corpus` (`scripts/demo.sh --until corpus`, or the whole demo).
For each storage dtype (the profile's own, then `float8_e4m3fn`) it plans the hidden-state version
of the same merged_train, extracts it (a version already complete is resumed, i.e. skipped), trains a
drafter on it with the profile's training settings through torchrun (same seed, same batches; a run
already finished resumes at its last step) and benchmarks it in-process. It prints one table: bytes
on disk, the final acc_0…acc_k and simulated acceptance, and the benchmark's acceptance length at the
headline configuration.

    python benchmarks/fp8_hidden_states.py [--profile demo] [--json out.json]

Run with DAGSTER_HOME unset: nothing here goes through the Dagster instance; the fp8 version's shards
go to `<run_root>/fp8_compare/hidden_states`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

FP8 = "float8_e4m3fn"


def run_one(profile, layout, log) -> dict:
    from eagle3_dagster.hidden.extraction_plan import build_plan, write_plan
    from eagle3_dagster.stages.bench import BenchSettings, benchmark_stage
    from eagle3_dagster.hidden.estimate import actual_bytes
    from eagle3_dagster.stages.hidden import ExtractSettings, extract_stage
    from eagle3_dagster.stages.train import TrainSettings, finish_training, prepare_training
    from eagle3_dagster.train import build_torchrun_command

    dtype = profile.hidden.dtype
    t0 = time.monotonic()
    plan = build_plan(profile, layout)
    plan_path = write_plan(plan)
    keys = [s.key for s in plan.shards]
    extract_stage(ExtractSettings.from_profile(profile), plan_path, keys, progress=log)
    t_extract = time.monotonic() - t0
    job = prepare_training(TrainSettings.from_profile(profile), layout, plan_path=plan_path)
    # The plain worker (no Pipes session outside Dagster), with the asset's own torchrun settings.
    command = build_torchrun_command(job.job_path, nproc_per_node=profile.train.nproc_per_node, python=sys.executable)
    subprocess.run(command, env={**os.environ, **job.env}, cwd=job.cwd, check=True)
    t_train = time.monotonic() - t0 - t_extract
    report, ok, detail = finish_training(TrainSettings.from_profile(profile), layout, job)
    if not ok:
        raise ValueError(detail)
    bench = benchmark_stage(
        BenchSettings.from_profile(profile),
        layout,
        export_dir=report.metadata["export_dir"],
        previous_results=None,
        run_id=f"fp8-compare-{dtype}",
        progress=log,
    )
    meta = report.metadata
    scope = "heldout" if meta["eval_scope"] == "heldout" else "train_batches"
    return {
        "dtype": dtype,
        "version": plan.version,
        "bytes": actual_bytes(plan.version_dir, keys),
        "num_tokens": sum(s.num_tokens for s in plan.shards),
        "steps": meta["steps"],
        "acc": [meta[f"{scope}_acc_{j}"] for j in range(profile.train.ttt_steps)],
        "eval_scope": scope,
        "sim_accept_length": meta[f"{scope}_sim_accept_length"],
        "final_loss": meta[f"{scope}_loss"],
        "bench_acceptance_length": bench.metadata.get("acceptance_length"),
        "bench_config": bench.metadata.get("headline_config"),
        "extract_s": round(t_extract, 1),
        "train_s": round(t_train, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import ArtifactLayout

    base = load_profile(args.profile)
    if base.hidden.dtype == FP8:
        raise SystemExit(f"profile {args.profile} already stores fp8: nothing to compare it with")
    fp8 = base.model_copy(
        update={
            "hidden": base.hidden.model_copy(
                update={"dtype": FP8, "root": str(Path(base.run_root) / "fp8_compare" / "hidden_states")}
            )
        }
    )
    rows = []
    for profile in (base, fp8):
        print(f"==> hidden.dtype {profile.hidden.dtype}", flush=True)
        rows.append(run_one(profile, ArtifactLayout.from_profile(profile), lambda line: print("   ", line, flush=True)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    full, low = rows
    print(
        f"\nprofile {args.profile}: {full['num_tokens']:,} tokens, {full['steps']} training steps each; "
        f"benchmark: {full['bench_config']}\n"
    )
    print(
        "| hidden.dtype | bytes | bytes / full | "
        + " | ".join(f"acc_{j}" for j in range(len(full["acc"])))
        + " | sim. acceptance | benchmark acceptance | final loss |"
    )
    print("|---|---:|---:|" + "---:|" * len(full["acc"]) + "---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['bytes']:,} | {r['bytes'] / full['bytes']:.3f} | "
            + " | ".join(f"{a:.4f}" for a in r["acc"])
            + f" | {r['sim_accept_length']:.4f} | {r['bench_acceptance_length']} | {r['final_loss']:.4f} |"
        )
    print(
        f"\nfp8 − full: acc_0 {low['acc'][0] - full['acc'][0]:+.4f}, simulated acceptance "
        f"{low['sim_accept_length'] - full['sim_accept_length']:+.4f}, benchmark acceptance "
        f"{(low['bench_acceptance_length'] or 0) - (full['bench_acceptance_length'] or 0):+.4f}"
    )


if __name__ == "__main__":
    main()
