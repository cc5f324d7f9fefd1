"""The target stage: build the tiny target (production observes an external one). The facts every later
stage needs about a target are `eagle3_dagster.target.target_facts`."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_dagster.config import TinyTargetConfig
from eagle3_dagster.contracts import ArtifactLayout
from eagle3_dagster.stages import Progress, StageReport, no_progress
from eagle3_dagster.stages import StageSettings, setting


@dataclass(frozen=True)
class TinyTargetSettings(StageSettings):
    """target_model (tiny): the shape and pre-training of the demo target."""

    tiny: TinyTargetConfig = setting("target.tiny")


@dataclass(frozen=True)
class ExternalTargetSettings(StageSettings):
    """target_model (external): the folder observed on the GPU host. Its identity is the observation's data
    version; the path is hashed too, so an edit to it marks everything built from the old target stale at the
    next reload, before the new folder is first observed."""

    path: str | None = setting("target.path")


def build_target(settings: TinyTargetSettings, layout: ArtifactLayout, progress: Progress = no_progress) -> StageReport:
    from eagle3_dagster.target_code import code_files
    from eagle3_dagster.threads import stage_threads
    from eagle3_dagster.tiny.build import build_tiny_target

    stage_threads(load_aware=True)  # one build from the start; the count is in build_report.json
    out = layout.target_dir
    report = build_tiny_target(settings.tiny, out, progress=progress)
    return StageReport(
        metadata={
            "path": out,
            "num_parameters": report.num_parameters,
            "tokens_seen": report.tokens_seen,
            "final_loss": float(report.final_loss),
            "build_seconds": round(float(report.build_seconds), 1),
            "tokenizer_vocab_size": report.tokenizer_vocab_size,
            "identity": report.identity,
            "code_files": code_files(out),
        },
        images={"loss_curve": out / "loss_curve.png"},
        series={"loss_by_step": (list(report.loss_curve), "pre-training step")},
        data_version=report.identity,
    )
