"""Hidden-state stages: the extraction plan and its estimate, shard extraction (hf or SGLang) and cleanup.

The version folder is derived from everything that changes the bytes (target,
merged_train, layers, dtype, backend, shard size), so a new corpus or target
extracts into a new version and the old one shows up as superseded in the plan.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from eagle3_dagster import storage
from eagle3_dagster.config import PROJECT_ROOT, DrafterOverrides
from eagle3_dagster.contracts import BACKEND_CODE_VERSIONS, PLAN_PATH_KEY, ArtifactLayout
from eagle3_dagster.hidden.estimate import (
    actual_bytes,
    cleanup_superseded,
    estimate_extraction,
    human_bytes,
    shard_bytes,
    shard_manifest_bytes,
)
from eagle3_dagster.hidden.extraction_plan import ExtractionPlan, load_plan, plan_for, write_plan
from eagle3_dagster.hidden.sharding import ShardSpec
from eagle3_dagster.hidden.shards import load_manifest, verify_shard
from eagle3_dagster.stages import Progress, StageReport, no_progress
from eagle3_dagster.stages import TARGET_FILES_RUN_WITH, StageSettings, TargetFiles, group, setting
from eagle3_dagster.target import target_facts_at

if TYPE_CHECKING:
    from eagle3_dagster.config import TrainConfig
    from eagle3_dagster.gpu_host import GpuHost
    from eagle3_dagster.train.schedule import TrainSchedule


@dataclass(frozen=True)
class ShardSettings(StageSettings):
    """What fixes the shards' bytes and where they go: the plan names the hidden-state version from them, and a
    shard run refuses a plan made with other ones (`refuse_other_plan`)."""

    root: str = setting("hidden.root")
    backend: str = setting("hidden.backend")
    aux_layers: list[int] | None = setting("hidden.aux_layers")
    dtype: str = setting("hidden.dtype")
    max_seq_len: int = setting("data.max_seq_len")
    samples_per_shard: int = setting("hidden.samples_per_shard")
    batch_tokens: int = setting("hidden.batch_tokens")  # the hf backend's batches round differently
    target: TargetFiles = group(runs_with=TARGET_FILES_RUN_WITH)

    def plan(self, layout: ArtifactLayout) -> ExtractionPlan:
        """Cut merged_train into shards and name their version (the plan extraction_plan writes)."""
        return plan_for(
            target_facts_at(self.target.model_dir(layout), self.aux_layers),
            layout,
            samples_per_shard=self.samples_per_shard,
            max_seq_len=self.max_seq_len,
            backend=self.backend,
            dtype=self.dtype,
            batch_tokens=self.batch_tokens,
        )


@dataclass(frozen=True)
class TrainScheduleSettings(StageSettings):
    """The training schedule the plan prints (optimizer steps, tokens per step): `train.schedule.train_schedule`
    reads these of `train`, under the same names."""

    batch_tokens: int = setting("train.batch_tokens")
    epochs: int = setting("train.epochs")
    eval_fraction: float = setting("train.eval_fraction")
    grad_accum: int = setting("train.grad_accum")
    max_steps: int | None = setting("train.max_steps")
    nnodes: int = setting("train.nnodes")
    nproc_per_node: int = setting("train.nproc_per_node")
    seed: int = setting("train.seed")
    warmup_ratio: float = setting("train.warmup_ratio")


DRAFT_KV_FIGURE = "the draft KV cache the plan reports beside it: a figure, not part of the plan"


@dataclass(frozen=True)
class PlanSettings(StageSettings):
    """extraction_plan: the shards and their version, and its prediction (hours, training schedule)."""

    shards: ShardSettings = group()
    throughput_tokens_per_s: float = setting("hidden.throughput_tokens_per_s")
    schedule: TrainScheduleSettings = group()
    hosts: list = setting(
        "gpu_host.hosts", runs_with="the hours on the hosts configured now; its table gives them for 1..N hosts"
    )
    drafter: DrafterOverrides = setting("drafter", runs_with=DRAFT_KV_FIGURE)
    serving_context: int = setting("target.serving_context", runs_with=DRAFT_KV_FIGURE)
    target_dtype: str = setting("target.dtype", runs_with=DRAFT_KV_FIGURE)


@dataclass(frozen=True)
class ExtractSettings(StageSettings):
    """hidden_states: the shards' settings, and the server that extracts them."""

    shards: ShardSettings = group()
    tp_size: int = setting("hidden.tp_size")  # tensor parallelism changes the sums' rounding
    sglang_port: int = setting("hidden.sglang_port", runs_with="where the server listens")
    sglang_server_args: list[str] = setting(
        "hidden.sglang_server_args",
        runs_with="the server's own options: one that would change a row is refused at launch",
    )
    sglang_concurrency: int = setting("hidden.sglang_concurrency", runs_with="parallel requests")
    sglang_version: str | None = setting("gpu_host.sglang_version", runs_with="the release the host must have")


def refuse_other_plan(plan: ExtractionPlan, shards: ShardSettings) -> None:
    """A shard run writes what its settings say or nothing: a plan made with other settings (a profile edited
    since extraction_plan was materialized) is refused, naming what differs."""
    root = storage.location(shards.root, PROJECT_ROOT)
    differs = {
        "hidden.root": (str(root.join(plan.version)), str(plan.version_dir)),
        "hidden.backend": (BACKEND_CODE_VERSIONS[shards.backend], plan.fmt.code_version),
        "hidden.dtype": (shards.dtype, plan.fmt.dtype),
        "hidden.aux_layers": (tuple(shards.aux_layers or plan.target.aux_layers), tuple(plan.target.aux_layers)),
        "hidden.samples_per_shard": (True, all(s.num_records <= shards.samples_per_shard for s in plan.shards)),
        "data.max_seq_len": (True, all(n <= shards.max_seq_len for s in plan.shards for n in s.lengths)),
    }
    named = [f"{name} ({now} now, the plan: {planned})" for name, (now, planned) in differs.items() if now != planned]
    if named:
        raise ValueError(
            f"hidden_states: the extraction plan was made with other settings: {'; '.join(named)}; "
            "materialize extraction_plan again"
        )


def free_space_location(layout: ArtifactLayout) -> Path:
    """Where extraction needs free disk: the folder shards are written in (hidden.root, or the staging folder
    of a root on a store)."""
    return storage.location(layout.hidden_root).local_folder(layout.staging_dir)


def plan_stage(settings: PlanSettings, layout: ArtifactLayout, free_bytes: int | None) -> tuple[StageReport, bool, str]:
    """The only stage that reads and hashes merged_train for extraction; it writes the plan (plan.json).
    `free_bytes` is measured at `free_space_location(layout)`."""
    plan = settings.shards.plan(layout)
    plan_path = write_plan(plan)
    estimate = estimate_extraction(
        plan.shards,
        plan.fmt,
        layout.hidden_root,
        plan.version,
        throughput_tokens_per_s=settings.throughput_tokens_per_s,
        free_bytes=free_bytes,
        num_hosts=len(settings.hosts),
        staging_dir=layout.staging_dir,
    )
    report = StageReport(
        metadata={
            "version": estimate.version,
            "version_dir": str(estimate.version_dir),
            "num_shards": estimate.num_shards,
            "num_samples": estimate.num_samples,
            "num_tokens": estimate.num_tokens,
            "total_bytes": estimate.total_bytes,
            "total_human": human_bytes(estimate.total_bytes),
            "remaining_bytes": estimate.remaining_bytes,
            "num_hosts": estimate.num_hosts,
            "estimated_hours": round(estimate.estimated_hours, 3),  # on num_hosts hosts
            "hours_by_hosts": {str(n): round(h, 3) for n, h in estimate.hours_by_hosts.items()},
            "free_bytes": estimate.free_bytes,
            "free_human": human_bytes(estimate.free_bytes),
            "free_at": estimate.free_at,
            "needed_bytes": estimate.needed_bytes,
            "fits": estimate.fits,
            "superseded_versions": [v.summary for v in estimate.superseded],
            "superseded_bytes": estimate.superseded_bytes,
            "aux_layers_canonical": list(plan.target.aux_layers),
            "merged_train_sha256": plan.merged_train_sha256,
            PLAN_PATH_KEY: str(plan_path),
            "train_schedule": asdict(training_schedule(settings.schedule, plan)),
            **draft_kv_cache(settings, plan.target.path),
        }
    )
    return report, estimate.fits, estimate.message


def draft_kv_cache(settings: PlanSettings, target_path: Path) -> dict:
    """What the drafter's KV cache costs served, per token and per sequence at target.serving_context: GQA keeps
    K and V of every KV head (2 x num_key_value_heads x head_dim values), MLA the latent and the shared rotary key
    (kv_lora_rank + qk_rope_head_dim), in the export's dtype (`eagle3 plan` prints it). A drafter.attention: mla
    the target cannot size is refused here, naming the field, before any extraction."""
    from eagle3_dagster.drafter.model import DrafterConfig
    from eagle3_dagster.drafter.target_head import TargetArch

    arch = TargetArch.from_dir(target_path)
    context = settings.serving_context
    cfg = DrafterConfig.from_profile(
        settings.drafter,
        arch,
        draft_vocab_size=arch.vocab_size,  # no bearing on the KV
        aux_layers=(),
        serving_context=context,
    )
    dtype = export_dtype(settings.target_dtype)
    per_token = cfg.kv_values_per_token() * (2 if dtype == "bfloat16" else 4)
    return {
        "draft_attention": cfg.attention,
        "draft_kv_dtype": dtype,
        "draft_kv_values_per_token": cfg.kv_values_per_token(),
        "draft_kv_bytes_per_token": per_token,
        "draft_kv_bytes_at_serving_context": per_token * context,
        "draft_kv_at_serving_context_human": human_bytes(per_token * context),
    }


def export_dtype(target_dtype: str) -> str:
    """The dtype the drafter is exported (and served) in for a target loaded in `target_dtype`."""
    return "bfloat16" if target_dtype == "bfloat16" else "float32"


def training_schedule(train: TrainScheduleSettings | TrainConfig, plan: ExtractionPlan) -> "TrainSchedule":
    """What `train` makes of these shards: optimizer steps, tokens per step (`eagle3 plan` prints it)."""
    from eagle3_dagster.train.schedule import train_schedule

    ids = [sid for s in plan.shards for sid in s.sample_ids]
    lengths = [n for s in plan.shards for n in s.lengths]
    world = train.nproc_per_node * train.nnodes
    return train_schedule(lengths, ids, train, world)


def extraction_preflight(settings: ExtractSettings, host: "GpuHost", root: Path | str) -> dict:
    """What a host needs to extract shards, checked in seconds before it is used (a lease's preflight): its
    interpreter runs, its GPUs are there, and SGLang is patched (sglang backend) or this project is importable
    (hf backend run on the host). Raises PreflightError naming the host and what is missing."""
    import sys

    from eagle3_dagster.gpu_host import PreflightError
    from eagle3_dagster.sglang.server import server_option

    sglang = settings.shards.backend == "sglang"
    on_gpus = sglang and server_option(settings.sglang_server_args, "--device") in (None, "cuda")
    report = host.preflight(
        str(root),
        min_gpus=max(host.spec.num_gpus, settings.tp_size if on_gpus else 0),
        require_sglang=sglang,
        require_patch=sglang,
        sglang_version=settings.sglang_version if sglang else None,
    )
    if not sglang and not host.is_this_process(sys.executable) and not report["eagle3_dagster"]:
        raise PreflightError(
            f"{host.where()}: interpreter {host.spec.python} cannot import eagle3_dagster, which "
            "runs the hf extraction there; install this project on the host"
        )
    return report


def extract_stage(
    settings: ExtractSettings,
    plan_path: Path | str,
    keys: list[str],
    *,
    gpu_host: "GpuHost | None" = None,
    host_report: dict | None = None,
    force: bool = False,
    progress: Progress = no_progress,
) -> tuple[StageReport, dict[str, tuple[bool, str]]]:
    """Extract the named shards of the plan at `plan_path` (extraction_plan's output) on `gpu_host`
    (`host_report`: its preflight, when the caller already ran it). `force` extracts shards complete in
    their manifest again, each replacing the old one whole (`extract.extract_shard`)."""
    plan = load_plan(plan_path)
    refuse_other_plan(plan, settings.shards)
    by_key = {s.key: s for s in plan.shards}
    unknown = [k for k in keys if k not in by_key]
    if unknown:
        raise KeyError(
            f"hidden_states: partitions {unknown} are not shards of the plan {plan_path} "
            f"({len(plan.shards)} shards); materialize extraction_plan for the current merged_train"
        )
    specs = [by_key[k] for k in keys]
    extra: dict = {}
    if settings.shards.backend == "hf":
        results = _extract_hf(settings, plan_path, plan, specs, gpu_host, progress, force)
    else:
        results, log_path = _extract_sglang(settings, plan_path, plan, specs, gpu_host, host_report, progress, force)
        extra["sglang_log"] = str(log_path)
    checks = shard_checks(plan, specs)
    report = StageReport(
        metadata={
            "version": plan.version,
            "version_dir": str(plan.version_dir),
            "shards": keys,
            "num_samples": sum(s.num_records for s in specs),
            "num_tokens": sum(s.num_tokens for s in specs),
            "bytes_written": actual_bytes(plan.version_dir, keys),
            "resumed_shards": sum(1 for r in results if r.get("skipped")),
            "reextracted_corrupt_shards": sum(1 for r in results if r.get("reextracted_corrupt")),
            "uploaded_from_staging_shards": sum(1 for r in results if r.get("uploaded_from_staging")),
            "forced": force,
            **extra,
            "backend": settings.shards.backend,
        }
    )
    return report, checks


def shard_checks(plan: ExtractionPlan, specs: list[ShardSpec]) -> dict[str, tuple[bool, str]]:
    keys = [s.key for s in specs]
    predicted = sum(shard_bytes(s, plan.fmt) + shard_manifest_bytes(s, plan.fmt) for s in specs)
    written = actual_bytes(plan.version_dir, keys)
    manifest = load_manifest(plan.version_dir)
    bad = []
    for key in keys:
        try:
            verify_shard(plan.version_dir.join(manifest[key]["file"]), manifest[key])
        except Exception as e:  # a missing or corrupted shard: name it in the check
            bad.append(f"{key}: {e}")
    return {
        "bytes_match_plan": (predicted == written, f"predicted {predicted} bytes, wrote {written}"),
        "manifest_checksums": (not bad, "; ".join(bad) or f"{len(keys)} shards verified"),
    }


def _extract_hf(
    settings: ExtractSettings,
    plan_path: Path | str,
    plan: ExtractionPlan,
    specs: list[ShardSpec],
    host: "GpuHost | None",
    progress: Progress,
    force: bool = False,
) -> list[dict]:
    """In this process when the host is this process's own interpreter on this machine; otherwise the
    hf driver on the host (`python -m eagle3_dagster.hidden.hf_driver`), one process for the shards."""
    import sys

    if host is None or host.is_this_process(sys.executable):
        from eagle3_dagster.hidden.hf_driver import extract_shards_hf
        from eagle3_dagster.threads import stage_threads

        stage_threads()
        return extract_shards_hf(plan, specs, batch_tokens=settings.shards.batch_tokens, progress=progress, force=force)
    argv = [
        host.spec.python,
        "-m",
        "eagle3_dagster.hidden.hf_driver",
        "--plan",
        str(plan_path),
        "--batch-tokens",
        str(settings.shards.batch_tokens),
        *(a for s in specs for a in ("--shard", s.key)),
        *(["--force"] if force else []),
    ]
    returncode, out = _run_driver(host, argv, f"hf-driver-{specs[0].key}", progress)
    if returncode != 0:
        raise RuntimeError(
            f"hidden_states{[s.key for s in specs]}: the hf driver exited {returncode} on "
            f"{host.where()}.\n--- driver output (last {len(out)} lines) ---\n" + "\n".join(out)
        )
    return [json.loads(line) for line in out if line.startswith('{"shard"')]


def _run_driver(host: "GpuHost", argv: list[str], name: str, progress: Progress) -> tuple[int, list[str]]:
    """A driver process on the host, its output streamed to `progress`; (exit code, its last 200 lines)."""
    from collections import deque

    proc = host.spawn(argv, storage.child_env(), name)  # the driver publishes to the store as the profile says
    out: deque[str] = deque(maxlen=200)
    assert proc.proc.stdout is not None  # spawned with stdout=PIPE
    for line in proc.proc.stdout:
        out.append(line.rstrip("\n"))
        progress(line.rstrip("\n"))
    returncode = proc.proc.wait()
    proc.release()
    return returncode, list(out)


def _extract_sglang(
    settings: ExtractSettings,
    plan_path: Path | str,
    plan: ExtractionPlan,
    specs: list[ShardSpec],
    host: "GpuHost | None",
    host_report: dict | None,
    progress: Progress,
    force: bool = False,
) -> tuple[list[dict], Path]:
    """One patched SGLang server for the batch of shards; the driver runs on the host beside the dump folder
    (`python -m eagle3_dagster.sglang.driver --plan ... --shard ...`), one process per shard.

    The server's log goes to a file under the hidden-states root (its path is in the metadata) and the
    run log; on failure the error carries its last 200 lines and the driver's own output (traceback
    included), so nothing that explains it passes through a throttle."""
    import time

    from eagle3_dagster.gpu_host import PreflightError
    from eagle3_dagster.sglang.driver import dump_folder
    from eagle3_dagster.sglang_releases import other_sglang_release
    from eagle3_dagster.sglang.server import LogTail, ServerSpec, sglang_server

    if host is None:
        raise ValueError("hidden.backend 'sglang' needs the gpu_host resource")
    local_root = plan.staging_dir  # the local folder shards are written in: dumps and logs stay on the host's disk
    if local_root is None:  # load_plan and build_plan always name it
        raise ValueError(f"the plan of {plan.version} names no local folder its shards are written in")
    report = host_report or extraction_preflight(settings, host, local_root)
    if (why := other_sglang_release(report, settings.sglang_version)) is not None:  # a report from elsewhere
        raise PreflightError(f"{host.where()}: interpreter {host.spec.python} {why}")
    log_path = local_root / ".logs" / f"sglang-{plan.version}-{time.strftime('%Y%m%dT%H%M%S')}.log"
    server_log = LogTail(log_path, echo=lambda line: progress(f"[sglang] {line}"))
    target = settings.shards.target
    spec = ServerSpec(
        model_path=str(plan.target.path),
        port=host.spec.server_port(settings.sglang_port),
        tp_size=settings.tp_size,
        dump_dir=str(dump_folder(plan)),
        dump_layers=plan.target.aux_layers,
        sglang_version=report["sglang_version"],
        trust_remote_code=target.trust_remote_code,
        reviewed_code=target.reviewed_code,
        extra_args=tuple(settings.sglang_server_args),
    )
    results = []
    try:
        with sglang_server(host, spec, on_log=server_log) as server:
            for i, shard in enumerate(specs, 1):
                argv = [
                    host.spec.python,
                    "-m",
                    "eagle3_dagster.sglang.driver",
                    "--plan",
                    str(plan_path),
                    "--shard",
                    shard.key,
                    "--base-url",
                    server.base_url,
                    "--concurrency",
                    str(settings.sglang_concurrency),
                    *(["--force"] if force else []),
                ]
                returncode, driver_out = _run_driver(host, argv, f"driver-{shard.key}", progress)
                if returncode != 0:
                    raise RuntimeError(
                        f"hidden_states[{shard.key}]: the SGLang driver exited {returncode} on {host.where()}.\n"
                        f"--- driver output (last {len(driver_out)} lines) ---\n"
                        + "\n".join(driver_out)
                        + f"\n--- SGLang log {log_path} (last {len(server_log.lines)} lines) ---\n"
                        + server_log.text()
                    )
                results.append(_driver_result(driver_out))
                progress(f"shard {shard.key} done ({i}/{len(specs)})")
    except RuntimeError as e:
        if str(log_path) in str(e):
            raise
        raise RuntimeError(
            f"{e}\n--- SGLang log {log_path} (last {len(server_log.lines)} lines) ---\n" + server_log.text()
        ) from e
    finally:
        server_log.close()
    return results, log_path


def _driver_result(lines) -> dict:
    """The driver's last stdout line is its JSON summary (skipped, re-extracted, bytes, ...)."""

    for line in reversed(lines):
        if line.startswith("{"):
            return json.loads(line)
    return {}


def cleanup_stage(
    settings: ShardSettings,
    layout: ArtifactLayout,
    *,
    dry_run: bool = True,
    log: Callable[[str], None] = print,
    plan_path: Path | str | None = None,
) -> StageReport:
    """Delete versions other than the planned one (from the plan at `plan_path`; the CLI, with no instance to ask,
    plans afresh)."""
    plan = load_plan(plan_path) if plan_path is not None else settings.plan(layout)
    result = cleanup_superseded(layout.hidden_root, plan.version, dry_run=dry_run, log=log)
    return StageReport(
        metadata={
            "dry_run": result.dry_run,
            "freed_bytes": result.freed_bytes,
            "freed_human": human_bytes(result.freed_bytes),
            "removed": [v.summary for v in result.removed],
        }
    )
