"""`eagle3`: the operations that are not materializations.

Patch SGLang on a GPU host's interpreter, preflight the host, print the
extraction plan, clean up superseded hidden-state versions (dry run unless
`--delete`), export shards to SpecForge/speculators layouts, benchmark any EAGLE-3 drafter
directory (`bench --drafter`, also one trained elsewhere), and print a model
directory's identity (what the production `target_model` observation runs on the
host). Everything here is engine code: no Dagster.

User errors (a bad profile, a missing input) print one line naming the problem
and exit 2; a check that fails exits 1; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

EXIT_FAILED_CHECK = 1
EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem the user fixes (profile, paths, missing inputs): a message, never a traceback."""


def build_parser() -> argparse.ArgumentParser:
    # --profile is accepted before or after the subcommand: each subparser knows it too, and the
    # subparser's copy defaults to SUPPRESS so it never overwrites a value given before the subcommand.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--profile", default=argparse.SUPPRESS, help="profile name or YAML path (default: $EAGLE3_PROFILE or demo)"
    )
    parser = argparse.ArgumentParser(
        prog="eagle3", description=__doc__.split("\n\n")[0].replace("\n", " "), parents=[common]
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, summary: str, details: str = "") -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=f"{summary}. {details}".strip(), parents=[common])

    p = add(
        "patch",
        "Apply, verify or revert the SGLang hidden-state dump patch",
        "Works on the SGLang installed in the given interpreter; refuses releases it does not know.",
    )
    p.add_argument("action", choices=["apply", "verify", "revert"])
    p.add_argument("--python", required=True, help="the interpreter whose SGLang is patched")
    add(
        "preflight",
        "Check the GPU host: interpreter, SGLang and patch, GPUs, free disk",
        "Prints a pass/fail table; exits 1 if any check the profile needs fails.",
    )
    add(
        "plan",
        "Print the extraction plan: bytes, hours, free space, superseded versions",
        "Hours are for the profile's GPU hosts, with 1, 2 and 4 hosts beside them. Exits 1 when the shards "
        "would not fit.",
    )
    add(
        "pool-limits",
        "Print the Dagster pool limits the profile implies, one 'POOL LIMIT' per line",
        "One gpu_host slot per GPU host. scripts/ui.sh and scripts/demo.sh apply them with `dagster instance "
        "concurrency set POOL LIMIT` before anything is queued.",
    )
    c = add("cleanup", "Delete superseded hidden-state versions", "A dry run unless --delete is given.")
    c.add_argument("--delete", action="store_true", help="really delete (default: only list what would go)")
    e = add("export-shards", "Export the current hidden-state shards to another tool's layout")
    e.add_argument("--format", choices=["specforge", "speculators"], required=True)
    e.add_argument("--out", type=Path, required=True, help="output folder")
    e.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="specforge: dtype of the states (default bfloat16, what SpecForge's TargetHead and draft "
        "compute in; a float32 feature fails there)",
    )
    b = add(
        "bench",
        "Benchmark a drafter directory against the profile's target, like benchmark_report",
        "Any standard EAGLE-3 export (LlamaForCausalLMEagle3 config.json + safetensors) is accepted, also one "
        "trained elsewhere (SpecForge's `export --to sglang` or `--to hf`); fields it lacks are defaulted the "
        "way SGLang serves it, and each default is printed.",
    )
    b.add_argument("--drafter", type=Path, required=True, help="the drafter directory (config.json + weights)")
    b.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where results, report.md and plots go (default: <bench folder>/drafter-<dir name>)",
    )
    b.add_argument("--previous", type=Path, default=None, help="a previous results JSON to compare with")
    t = add("target-info", "Print a model directory's identity, summary and code files (name: sha256) as JSON")
    t.add_argument("model_dir", type=Path)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except UserError as e:
        print(f"eagle3 {args.command}: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


def _run(args: argparse.Namespace) -> int:
    from eagle3_dagster.config import ProfileError

    if args.command == "patch":
        from eagle3_dagster.sglang.patch import main as patch_main

        return patch_main([args.action, "--python", args.python])
    if args.command == "target-info":
        from eagle3_dagster.target import target_identity, target_summary
        from eagle3_dagster.target_code import code_files

        if not (args.model_dir / "config.json").exists():
            raise UserError(f"{args.model_dir}: not a model directory (no config.json)")
        print(
            json.dumps(
                {
                    "identity": target_identity(args.model_dir),
                    **target_summary(args.model_dir),
                    "code_files": code_files(args.model_dir),
                }
            )
        )
        return 0

    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import ArtifactLayout

    try:
        profile = load_profile(getattr(args, "profile", None))
    except ProfileError as e:
        raise UserError(str(e)) from None
    from eagle3_dagster import storage

    storage.configure(profile.storage)
    layout = ArtifactLayout.from_profile(profile)
    if args.command == "pool-limits":
        from eagle3_dagster.host_lease import pool_limits

        for pool, limit in pool_limits(len(profile.gpu_host.hosts)).items():
            print(pool, limit)
        return 0
    try:
        if args.command == "preflight":
            return _preflight(profile, layout)
        if args.command == "plan":
            from eagle3_dagster.stages.hidden import PlanSettings, plan_stage
            from eagle3_dagster.train.schedule import TrainSchedule

            report, fits, message = plan_stage(PlanSettings.from_profile(profile), layout, free_bytes=None)
            _print_metadata(report.metadata)
            print(hours_table(report.metadata["hours_by_hosts"], report.metadata["num_hosts"]))
            print("training: " + TrainSchedule(**report.metadata["train_schedule"]).describe())
            print(message)
            return 0 if fits else EXIT_FAILED_CHECK
        if args.command == "cleanup":
            from eagle3_dagster.stages.hidden import ShardSettings, cleanup_stage

            report = cleanup_stage(ShardSettings.from_profile(profile), layout, dry_run=not args.delete, log=print)
            _print_metadata(report.metadata)
            return 0
        if args.command == "export-shards":
            return _export(profile, layout, args.format, args.out, args.dtype)
        if args.command == "bench":
            return _bench(profile, layout, args.drafter, args.out, args.previous)
    except FileNotFoundError as e:  # a stage whose input was never built names it
        raise UserError(str(e).strip("'\"")) from None
    return EXIT_USER_ERROR


def hours_table(hours_by_hosts: dict[str, float], num_hosts: int) -> str:
    """The remaining extraction's wall hours on 1, 2, 4 and the profile's number of hosts, side by side."""
    cells = [
        (f"{n} host{'s' if int(n) > 1 else ''}" + (" (profile)" if int(n) == num_hosts else ""), f"{h:,.1f} h")
        for n, h in sorted(hours_by_hosts.items(), key=lambda kv: int(kv[0]))
    ]
    widths = [max(len(a), len(b)) for a, b in cells]
    return "\n".join(
        [
            "hours   " + "  ".join(a.rjust(w) for (a, _), w in zip(cells, widths)),
            "        " + "  ".join(b.rjust(w) for (_, b), w in zip(cells, widths)),
        ]
    )


def preflight_checks(profile, report: dict, num_gpus: int | None = None) -> list[tuple[str, str, str]]:
    """(check, PASS|FAIL|SKIP, detail) for everything the profile needs of a GPU host (`num_gpus`: that
    host's; default the profile's first host's)."""
    from eagle3_dagster.sglang_releases import other_sglang_release

    needs_sglang = profile.hidden.backend == "sglang" or profile.bench.mode == "served"
    host_gpus = profile.gpu_host.hosts[0].num_gpus if num_gpus is None else num_gpus
    min_gpus = max(host_gpus, profile.hidden.tp_size if needs_sglang else 0)

    def row(name: str, needed: bool, ok: bool, detail: str) -> tuple[str, str, str]:
        return name, ("PASS" if ok else "FAIL") if needed else "SKIP", detail + ("" if needed else " (not needed)")

    sglang = report.get("sglang_version") or report.get("sglang_error") or "not installed"
    return [
        ("interpreter", "PASS", f"{report.get('python')} (Python {report.get('python_version')})"),
        row("sglang", needs_sglang, not report.get("sglang_error"), str(sglang)),
        row(
            "sglang_release",
            needs_sglang and profile.gpu_host.sglang_version is not None,
            other_sglang_release(report, profile.gpu_host.sglang_version) is None,
            f"{report.get('sglang_version')} installed, gpu_host.sglang_version {profile.gpu_host.sglang_version}",
        ),
        row("patch", needs_sglang, report.get("patch_state") == "patched", str(report.get("patch_state", "n/a"))),
        row(
            "eagle3_dagster",
            needs_sglang,
            bool(report.get("eagle3_dagster")),
            "importable" if report.get("eagle3_dagster") else "not importable on the host",
        ),
        row(
            "gpus",
            min_gpus > 0,
            report.get("gpu_count", 0) >= min_gpus,
            f"{report.get('gpu_count', 0)} visible, {min_gpus} needed"
            + (f" ({report['gpu_error']})" if report.get("gpu_error") else ""),
        ),
        row(
            "free_disk",
            True,
            report.get("free_bytes", 0) > 0,
            f"{report.get('free_bytes', 0) / 2**30:.1f} GiB free at {profile.hidden.root}",
        ),
    ]


def _preflight(profile, layout) -> int:
    """Every host of the profile, each with its own table; exits 1 when any host fails (a run would skip it)."""
    from eagle3_dagster.gpu_host import GpuHost, PreflightError
    from eagle3_dagster.stages.hidden import free_space_location

    failed_hosts = []
    for h in profile.gpu_host.hosts:
        host = GpuHost(h)
        print(f"host {host.name}")
        try:  # the probe only: each requirement is judged below, all of them, not just the first that fails
            report = host.preflight(str(free_space_location(layout)), require_sglang=False)
        except PreflightError as e:
            print(f"{'interpreter':<15} FAIL  {e}")
            failed_hosts.append(f"{host.name} (interpreter)")
            continue
        rows = preflight_checks(profile, report, h.num_gpus)
        for name, status, detail in rows:
            print(f"{name:<15} {status:<5} {detail}")
        failed = [name for name, status, _ in rows if status == "FAIL"]
        if failed:
            failed_hosts.append(f"{host.name} ({', '.join(failed)})")
    if failed_hosts:
        print(f"preflight failed: {'; '.join(failed_hosts)}", file=sys.stderr)
        return EXIT_FAILED_CHECK
    return 0


def _export(profile, layout, fmt: str, out: Path, dtype: str | None = None) -> int:
    import torch
    from tqdm import tqdm

    from eagle3_dagster.hidden.export_formats import (
        SPECFORGE_DTYPE,
        ExportFolderError,
        export_specforge,
        export_speculators,
        load_final_norm_weight,
        specforge_target_dir,
    )
    from eagle3_dagster.hidden.extraction_plan import build_plan
    from eagle3_dagster.hidden.shards import ShardCorruptError

    plan = build_plan(profile, layout)
    if not plan.version_dir.exists():
        raise UserError(f"hidden-state version {plan.version} has no shards at {plan.version_dir}; extract first")
    if dtype is not None and fmt != "specforge":
        raise UserError("--dtype applies to --format specforge only")
    try:
        with tqdm(total=1, desc=f"export {plan.version} → {fmt}") as bar:
            if fmt == "specforge":
                export_specforge(plan.version_dir, out, dtype=getattr(torch, dtype) if dtype else SPECFORGE_DTYPE)
            else:
                export_speculators(plan.version_dir, out, final_norm_weight=load_final_norm_weight(plan.target.path))
            bar.update(1)
    except ShardCorruptError as e:  # a failed check: the shards training would refuse are not exported either
        print(f"eagle3 export-shards: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAILED_CHECK
    except ExportFolderError as e:  # --out holds someone else's files
        raise UserError(_one_line(e)) from None
    print(f"exported {plan.version_dir} to {out} ({fmt})")
    if fmt == "specforge":
        from eagle3_dagster.drafter.target_head import SUFFIXES, _find
        from eagle3_dagster.safetensors_folder import weight_files

        target = specforge_target_dir(plan.target.path, out)
        lm_head = _find(weight_files(Path(target), links_out=True), SUFFIXES["lm_head"])
        # SpecForge 0.2.0 config/schema.py: model.target_model_path, data.hidden_states_path, model.lm_head_key
        print(
            f"SpecForge (offline): model.target_model_path: {target}  data.hidden_states_path: {out}"
            + (f"  model.lm_head_key: {lm_head}" if lm_head and lm_head != "lm_head.weight" else "")
        )
    return 0


def _bench(profile, layout, drafter: Path, out: Path | None, previous: Path | None) -> int:
    """The benchmark stage on a drafter directory; the served backend needs a GPU host (`eagle3 preflight`)."""
    import time

    from eagle3_dagster.drafter.imported import check_drafter_dir
    from eagle3_dagster.io import ForeignInputError
    from eagle3_dagster.stages.bench import BenchSettings, benchmark_stage

    if not (drafter / "config.json").exists():
        raise UserError(f"{drafter}: not a drafter directory (no config.json)")
    try:  # the folder may come from anywhere: its values and files are checked before anything reads them
        check_drafter_dir(drafter)
    except ForeignInputError as e:  # names the file and the field
        raise UserError(_one_line(e)) from None
    except FileNotFoundError:  # no weights at all: the loader names that, after the target it is for
        pass
    out = out or layout.bench_dir / f"drafter-{drafter.resolve().name}"
    run_id = time.strftime("%Y%m%d-%H%M%S")
    try:
        with _leased_host(profile, run_id) as host:  # served: a host of its own while it serves, as a run's
            report = benchmark_stage(
                BenchSettings.from_profile(profile),
                layout,
                export_dir=drafter,
                previous_results=str(previous) if previous else None,
                run_id=run_id,
                gpu_host=host,
                progress=print,
                out_dir=out,
            )
    except ForeignInputError as e:
        raise UserError(_one_line(e)) from None
    except (KeyError, ValueError) as e:  # a directory that is not an EAGLE-3 drafter for this target
        raise UserError(f"{drafter}: {_one_line(e)}") from None
    _print_metadata({k: v for k, v in report.metadata.items() if k != "drafter_notes"})
    for note in report.metadata.get("drafter_notes", []):
        print(f"note: {note}")
    print(f"report: {out / 'report.md'}")
    return 0


@contextlib.contextmanager
def _leased_host(profile, run_id: str):
    """The served benchmark's GPU host, leased as `benchmark_report` leases it (the first free host of
    gpu_host.hosts, in the lease folder the Dagster runs use), for the block; None for the simulated one.
    Unleased, its launch stopped the live server of an extraction on the same host and port."""
    if profile.bench.mode != "served":
        yield None
        return
    from eagle3_dagster.gpu_host import GpuHost
    from eagle3_dagster.host_lease import NoHostError, lease_host

    hosts = [GpuHost(h) for h in profile.gpu_host.hosts]
    holder = {"run_id": f"eagle3-bench-{run_id}", "command": "eagle3 bench"}
    try:
        with lease_host(
            [(h.name, h) for h in hosts],
            lease_folder(profile),
            holder=holder,
            log=print,
            wait_s=profile.gpu_host.lease_wait_s,
        ) as lease:
            yield lease.host
    except NoHostError as e:
        raise UserError(_one_line(e)) from None


def lease_folder(profile) -> Path:
    """Where the Dagster runs lease GPU hosts: gpu_host.lease_dir, else `gpu_host_leases` under the storage of
    the instance in DAGSTER_HOME (its dagster.yaml `local_artifact_storage` base_dir, default DAGSTER_HOME/storage:
    what `resources/gpu_host.py` uses). Neither known: refused, since a lease taken anywhere else guards nothing."""
    if profile.gpu_host.lease_dir:
        return Path(profile.gpu_host.lease_dir)
    home = os.environ.get("DAGSTER_HOME")
    if not home:
        raise UserError(
            "the served benchmark leases its GPU host where the Dagster runs lease theirs, and that "
            "folder is unknown: set gpu_host.lease_dir in the profile, or DAGSTER_HOME to the instance's "
            "folder"
        )
    import yaml

    storage = Path(home) / "storage"
    try:
        instance = yaml.safe_load((Path(home) / "dagster.yaml").read_text()) or {}
    except FileNotFoundError:
        instance = {}
    base_dir = (
        ((instance.get("local_artifact_storage") or {}).get("config") or {}).get("base_dir")
        if isinstance(instance, dict)
        else None
    )
    if isinstance(base_dir, dict) and isinstance(base_dir.get("env"), str):
        base_dir = os.environ.get(base_dir["env"])
    if base_dir is not None and not isinstance(base_dir, str):
        raise UserError(
            f"{Path(home) / 'dagster.yaml'}: local_artifact_storage base_dir {base_dir!r} is not a "
            "path; set gpu_host.lease_dir in the profile"
        )
    return (Path(base_dir) if base_dir else storage) / "gpu_host_leases"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _print_metadata(meta: dict) -> None:
    width = max((len(k) for k in meta), default=0)
    for k, v in meta.items():
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    raise SystemExit(main())
