"""The hf backend on a GPU host: `python -m eagle3_dagster.hidden.hf_driver --plan PLAN --shard KEY ...`.

The `hidden_states` asset runs this over the leased host's transport when that
host is not the Dagster worker's own interpreter (an SSH host, or another local
environment). It reads the plan (extraction_plan's output, on storage
the host sees), extracts the named shards with the same function the in-process
path uses (`extract_shards_hf`), prints progress lines and, per
shard, one JSON summary line starting with `{"shard"`. Resume is the engine's:
a shard complete in its manifest is skipped (unless `--force`), a half-written one is redone.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from eagle3_dagster.progress import Progress, ProgressMeter

if TYPE_CHECKING:
    from eagle3_dagster.hidden.extraction_plan import ExtractionPlan
    from eagle3_dagster.hidden.sharding import ShardSpec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_dagster.hidden.hf_driver", description=__doc__)
    parser.add_argument("--plan", required=True, help="the plan (plan.json) extraction_plan wrote")
    parser.add_argument("--shard", action="append", required=True, help="a shard key of the plan (repeatable)")
    # Not in the plan's fields, so a flag: how many tokens go through the model per forward (the version id
    # hashes it, since it changes the bytes, but plan.json does not carry it); --force is the run's own choice.
    parser.add_argument("--batch-tokens", type=int, required=True, help="hidden.batch_tokens")
    parser.add_argument("--force", action="store_true", help="extract the shards again even when complete")
    args = parser.parse_args(argv)

    from eagle3_dagster.hidden.extraction_plan import load_plan
    from eagle3_dagster.threads import stage_threads

    stage_threads()  # the cores this host gives the driver
    plan = load_plan(args.plan)
    by_key = {s.key: s for s in plan.shards}
    unknown = [k for k in args.shard if k not in by_key]
    if unknown:
        print(f"shards {unknown} are not in the plan {args.plan} ({len(by_key)} shards)", file=sys.stderr)
        return 2
    results = extract_shards_hf(
        plan,
        [by_key[k] for k in args.shard],
        batch_tokens=args.batch_tokens,
        progress=lambda line: print(line, flush=True),
        force=args.force,
    )
    for r in results:
        print(json.dumps(r), flush=True)
    return 0


def extract_shards_hf(
    plan: ExtractionPlan, specs: list[ShardSpec], *, batch_tokens: int, progress: Progress, force: bool = False
) -> list[dict]:
    """The hf backend over some shards of a plan, with one loaded model in the plan's dtype (`force`: complete
    shards too)."""
    from eagle3_dagster.hidden.extract_hf import extract_shard_hf, load_target_hf

    dtype = plan.fmt.dtype
    model = load_target_hf(plan.target.path, dtype)
    results = []
    for spec in specs:
        # extract_shard_hf counts tokens as progress(done, total): a meter turns that into the contract's line
        meter = ProgressMeter(progress, f"hidden_states[{spec.key}]", "tokens", spec.num_tokens)
        r = extract_shard_hf(
            plan.target.path,
            plan.merged_train,
            spec,
            plan.version_dir,
            aux_layers=list(plan.target.aux_layers),
            dtype=dtype,
            batch_tokens=batch_tokens,
            code_version=plan.fmt.code_version,
            log=progress,
            target_identity=plan.target.identity,
            progress=meter,
            model=model,
            staging_dir=plan.staging_dir,
            force=force,
        )
        if r.skipped:
            progress(f"hidden_states[{spec.key}]: complete in the manifest, skipped")
        results.append(
            {
                "shard": spec.key,
                "skipped": r.skipped,
                "reextracted_corrupt": r.reextracted_corrupt,
                "uploaded_from_staging": r.uploaded_from_staging,
            }
        )
    return results


if __name__ == "__main__":
    raise SystemExit(main())
