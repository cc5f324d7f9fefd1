"""`eagle3`: the operations that are not materializations.

Patch SGLang on a GPU host's interpreter, preflight the host, print the
extraction plan, clean up superseded hidden-state versions (dry run unless
`--delete`), export shards to SpecForge/speculators layouts, and print a model
directory's identity (what the production `target_model` observation runs on the
host). Everything here is engine code: no Dagster.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3", description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=None, help="profile name or YAML path (default: $EAGLE3_PROFILE or demo)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("patch", help="apply, verify or revert the SGLang hidden-state dump patch")
    p.add_argument("action", choices=["apply", "verify", "revert"])
    p.add_argument("--python", required=True, help="the interpreter whose SGLang is patched")

    sub.add_parser("preflight", help="check the GPU host: interpreter, SGLang and patch, GPUs, free disk")
    sub.add_parser("plan", help="print the extraction plan: bytes, hours, free space, superseded versions")
    c = sub.add_parser("cleanup", help="delete superseded hidden-state versions (dry run by default)")
    c.add_argument("--delete", action="store_true", help="really delete (default: only list what would go)")
    e = sub.add_parser("export-shards", help="export the current hidden-state shards to another tool's layout")
    e.add_argument("--format", choices=["specforge", "speculators"], required=True)
    e.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("target-info", help="print a model directory's identity and summary as JSON")
    t.add_argument("model_dir", type=Path)

    args = parser.parse_args(argv)
    if args.command == "patch":
        from eagle3_dagster.sglang.patch import main as patch_main

        return patch_main([args.action, "--python", args.python])
    if args.command == "target-info":
        from eagle3_dagster.target import target_identity, target_summary

        print(json.dumps({"identity": target_identity(args.model_dir), **target_summary(args.model_dir)}))
        return 0

    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import ArtifactLayout

    profile = load_profile(args.profile)
    layout = ArtifactLayout.from_profile(profile)
    if args.command == "preflight":
        return _preflight(profile, layout)
    if args.command == "plan":
        from eagle3_dagster.stages.hidden import plan_stage

        report, fits, message = plan_stage(profile, layout, free_bytes=None)
        _print_metadata(report.metadata)
        print(message)
        return 0 if fits else 1
    if args.command == "cleanup":
        from eagle3_dagster.stages.hidden import cleanup_stage

        report = cleanup_stage(profile, layout, dry_run=not args.delete, log=print)
        _print_metadata(report.metadata)
        return 0
    if args.command == "export-shards":
        return _export(profile, layout, args.format, args.out)
    return 2


def _preflight(profile, layout) -> int:
    from eagle3_dagster.gpu_host import GpuHost, HostSpec, PreflightError

    g = profile.gpu_host
    host = GpuHost(HostSpec(g.transport, g.python, g.workdir, g.ssh_target, tuple(g.ssh_options)))
    needs_sglang = profile.hidden.backend == "sglang"
    try:
        report = host.preflight(str(layout.hidden_root), min_gpus=g.num_gpus, require_sglang=needs_sglang,
                                require_patch=needs_sglang)
    except PreflightError as e:
        print(f"preflight failed: {e}", file=sys.stderr)
        return 1
    _print_metadata(report)
    return 0


def _export(profile, layout, fmt: str, out: Path) -> int:
    from tqdm import tqdm

    from eagle3_dagster.hidden.export_formats import export_specforge, export_speculators, load_final_norm_weight
    from eagle3_dagster.stages.hidden import hidden_context

    ctx = hidden_context(profile, layout)
    with tqdm(total=1, desc=f"export {ctx.version} → {fmt}") as bar:
        if fmt == "specforge":
            export_specforge(ctx.version_dir, out)
        else:
            export_speculators(ctx.version_dir, out, final_norm_weight=load_final_norm_weight(ctx.target.path))
        bar.update(1)
    print(f"exported {ctx.version_dir} to {out} ({fmt})")
    return 0


def _print_metadata(meta: dict) -> None:
    width = max((len(k) for k in meta), default=0)
    for k, v in meta.items():
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    raise SystemExit(main())
