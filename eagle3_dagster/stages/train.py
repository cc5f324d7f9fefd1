"""The training stage: describe the torchrun job, then read back what it wrote.

The run folder is named by a hash of the job description, so a retry of the
same job finds its checkpoints and resumes, while a new corpus, target or
hyperparameter set starts a fresh run beside the old one.

Nothing wrong is trusted: training starts only when every shard's bytes match
its manifest (sha256), and its export is handed on only when `check_export`
passes (names, shapes, every weight finite). There is no side pointer to "the
current drafter": the export's path is `export_dir` in the drafter_checkpoint
materialization's metadata, and the benchmark reads it from there. An export
that fails its check is reported as the failed check with its path as
`refused_export_dir`, never as `export_dir`, and is not published.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from eagle3_dagster import storage
from eagle3_dagster.config import PROJECT_ROOT, DrafterOverrides, TrainConfig
from eagle3_dagster.contracts import ArtifactLayout
from eagle3_dagster.provenance import provenance
from eagle3_dagster.stages import StageReport
from eagle3_dagster.threads import thread_env
from eagle3_dagster.hidden.extraction_plan import load_plan
from eagle3_dagster.stages import StageSettings, setting

# The engine's own torchrun worker; a caller may run a wrapper taking the same arguments instead.
ENGINE_WORKER = "eagle3_dagster.train"


@dataclass(frozen=True)
class TrainSettings(StageSettings):
    """drafter_checkpoint: how the drafter is shaped and trained, and what its export is written for."""

    train: TrainConfig = setting("train")
    drafter: DrafterOverrides = setting("drafter")
    serving_context: int = setting("target.serving_context")  # the export's max_position_embeddings
    target_dtype: str = setting("target.dtype")  # the export's dtype
    # the export's aux ids and EAGLE 3.1 options are written for the SGLang release that will serve it
    sglang_version: str | None = setting("gpu_host.sglang_version")


@dataclass(frozen=True)
class TrainLaunch:
    command: list[str]  # torchrun with this interpreter; empty when the rendezvous is chosen at launch (nodes.py)
    env: dict[str, str]
    cwd: str
    job_path: Path
    out_dir: Path
    worker: str = ENGINE_WORKER  # the module torchrun runs on every rank


def prepare_training(
    settings: TrainSettings,
    layout: ArtifactLayout,
    *,
    plan_path: Path | str,
    python: str | None = None,
    worker: str = ENGINE_WORKER,
) -> TrainLaunch:
    """The torchrun job for the shards of extraction_plan's plan at `plan_path`.

    `worker`: the module torchrun runs, the engine's own or a wrapper with its arguments (the caller's
    choice: the asset passes its Dagster Pipes child)."""
    from eagle3_dagster.hidden.shards import load_manifest
    from eagle3_dagster.train import TrainJobConfig, build_torchrun_command

    plan = load_plan(plan_path)
    done = load_manifest(plan.version_dir)  # empty when the version folder does not exist
    missing = [s.key for s in plan.shards if s.key not in done]
    if missing:
        raise RuntimeError(
            f"drafter_checkpoint: hidden-state version {plan.version} lacks {len(missing)} of {len(plan.shards)} "
            f"shards (first: {missing[:5]}); backfill hidden_states first"
        )
    verify_shards(plan.version_dir, [s.key for s in plan.shards], done)
    if not layout.vocab_mapping.exists():
        raise FileNotFoundError(f"vocab_mapping: {layout.vocab_mapping} not found; materialize vocab_mapping first")
    job = TrainJobConfig(
        hidden_version_dir=str(plan.version_dir),
        target_dir=str(plan.target.path),
        vocab_mapping=str(layout.vocab_mapping),
        out_dir="",
        serving_context=settings.serving_context,
        train=settings.train,
        drafter=settings.drafter,
        aux_layers=plan.target.aux_layers,
        export_dtype="bfloat16" if settings.target_dtype == "bfloat16" else "float32",
        sglang_versions=(settings.sglang_version,) if settings.sglang_version else None,
    )
    run_id = hashlib.sha256(job.to_json().encode()).hexdigest()[:12]
    out_dir = layout.drafter_dir / f"run-{run_id}"
    job = replace(job, out_dir=str(out_dir), metadata=provenance(job.to_json()) | {"hidden_version": plan.version})
    job_path = out_dir / "job.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    job.write(job_path)
    t = settings.train
    # drafter_checkpoint builds each leased host's own command (train/nodes.py); this one, for this interpreter,
    # exists when the job needs no launch-time choice: one node, or a fixed rendezvous endpoint
    command = (
        build_torchrun_command(
            job_path,
            nproc_per_node=t.nproc_per_node,
            nnodes=t.nnodes,
            python=python or _python(),
            module=worker,
            rdzv_endpoint=t.rdzv_endpoint,
            rdzv_id=t.rdzv_id,
        )
        if t.nnodes == 1 or t.rdzv_endpoint
        else []
    )
    # ranks x threads <= the cores this process gets (eagle3_dagster.threads); the user's OMP_NUM_THREADS wins;
    # the workers read shards from the store as the profile says
    env = {**thread_env(t.nproc_per_node), "TOKENIZERS_PARALLELISM": "false", **storage.child_env()}
    return TrainLaunch(
        command=command, env=env, cwd=str(PROJECT_ROOT), job_path=job_path, out_dir=out_dir, worker=worker
    )


def verify_shards(
    version_dir: storage.Location | Path, keys: list[str], manifest: dict[str, dict], *, workers: int = 8
) -> None:
    """Every shard's size and sha256 against its manifest entry; a `ShardCorruptError` naming each bad shard.

    Hashing reads every byte (4.6 TiB for the production corpus); threads overlap the reads (hashlib
    releases the GIL), and the cost is small beside the extraction it protects and the training it gates."""
    from eagle3_dagster.hidden.shards import ShardCorruptError, shard_path, verify_shard

    def check(key: str) -> str | None:
        try:
            verify_shard(shard_path(version_dir, key), manifest[key])
        except ShardCorruptError as e:
            return str(e)
        return None

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(keys)))) as pool:
        problems = [p for p in pool.map(check, keys) if p]
    if problems:
        raise ShardCorruptError(
            f"drafter_checkpoint: {len(problems)} of {len(keys)} hidden-state shards do not match their manifest; "
            f"training does not start on them. Materialize those hidden_states partitions again (resume "
            f"re-extracts a shard failing its checksum):\n  " + "\n  ".join(problems)
        )


def finish_training(
    settings: TrainSettings, layout: ArtifactLayout, launch: TrainLaunch
) -> tuple[StageReport, bool, str]:
    """Read back what training wrote: the report, whether the export passed `check_export` and what it found.

    An export that fails its check (a missing, misshaped or non-finite weight) is named only as
    `refused_export_dir`, never `export_dir`, and is not published: the caller reports the failed check, and
    nothing downstream can read the export from the metadata."""
    from eagle3_dagster.drafter.export import check_export
    from eagle3_dagster.train.outputs import summary_metadata

    metrics = storage.read_json(launch.out_dir / "metrics.json")
    export_dir = launch.out_dir / "export"
    check = check_export(export_dir)
    named: dict[str, object]
    if check.ok:
        detail, named = "ok", {"export_dir": export_dir}
    else:
        detail, named = f"the export in {export_dir} is refused: {check}", {"refused_export_dir": export_dir}
    if check.ok and settings.train.export_location:
        from eagle3_dagster.drafter.publish import publish_export

        dest = storage.location(settings.train.export_location, PROJECT_ROOT).join(launch.out_dir.name)
        publish_export(export_dir, dest, log=lambda _line: None)
        named["export_location"] = str(dest)
    report = StageReport(
        metadata={"run_dir": launch.out_dir, **named, **summary_metadata(metrics)},
        images={"curves": launch.out_dir / "curves.png"},
        series={
            "loss_by_step": (list(metrics["curves"]["loss"]), "training step"),
            "acc_0_by_step": (list(metrics["curves"]["acc_0"]), "training step"),
        },
    )
    return report, check.ok, detail


def _python() -> str:
    import sys

    return sys.executable
