"""The target stage, and the facts about the target every later stage needs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3_dagster.config import Profile
from eagle3_dagster.contracts import ArtifactLayout
from eagle3_dagster.layers import default_aux_layers, validate_aux_layers
from eagle3_dagster.stages import Progress, StageReport, no_progress


@dataclass(frozen=True)
class TargetFacts:
    path: Path
    identity: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layers: tuple[int, ...]  # canonical numbering


def target_dir(profile: Profile, layout: ArtifactLayout) -> Path:
    return layout.target_dir if profile.target.kind == "tiny" else Path(profile.target.path)


def target_facts(profile: Profile, layout: ArtifactLayout) -> TargetFacts:
    from eagle3_dagster.target import target_identity, target_summary

    path = target_dir(profile, layout)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"target_model: {path}/config.json not found; materialize target_model first")
    summary = target_summary(path)
    layers = profile.hidden.aux_layers or default_aux_layers(summary["num_layers"])
    return TargetFacts(
        path=path,
        identity=target_identity(path),
        num_layers=summary["num_layers"],
        hidden_size=summary["hidden_size"],
        vocab_size=summary["vocab_size"],
        aux_layers=tuple(validate_aux_layers(list(layers), summary["num_layers"])),
    )


def build_target(profile: Profile, layout: ArtifactLayout, progress: Progress = no_progress) -> StageReport:
    from eagle3_dagster.tiny.build import build_tiny_target

    out = layout.target_dir
    report = build_tiny_target(profile.target.tiny, out, progress=progress)
    return StageReport(
        metadata={
            "path": out,
            "num_parameters": report.num_parameters,
            "tokens_seen": report.tokens_seen,
            "final_loss": float(report.final_loss),
            "build_seconds": round(float(report.build_seconds), 1),
            "tokenizer_vocab_size": report.tokenizer_vocab_size,
            "identity": report.identity,
        },
        images={"loss_curve": out / "loss_curve.png"},
        data_version=report.identity,
    )
