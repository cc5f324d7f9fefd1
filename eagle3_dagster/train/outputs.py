"""What a finished training run leaves: `metrics.json`, `curves.png` and the SGLang/vLLM export.

Written by rank 0 of the torchrun worker (`worker.py`); `summary_metadata` is the
figures it reports to the orchestrator.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_dagster.drafter.export import export_drafter
from eagle3_dagster.drafter.model import Eagle3Drafter
from eagle3_dagster.io import atomic_open, atomic_write_json
from eagle3_dagster.train.loop import Trainer


def write_outputs(job, trainer: Trainer, drafter: Eagle3Drafter, final: dict, timing: dict, out: Path) -> dict:
    from eagle3_dagster.storage import read_json

    initial_path = out / "initial_eval.json"
    k = job.train.ttt_steps
    metrics = {
        "steps": trainer.step,
        "tokens_seen": trainer.tokens_seen,
        **timing,
        "initial_eval": read_json(initial_path) if initial_path.exists() else None,
        "final_eval": final,
        "final": {f"acc_{j}": final[f"acc_{j}"] for j in range(k)}
        | {"sim_accept_length": final["sim_accept_length"], "loss": final["loss"]},
        "curves": {
            key: [h[key] for h in trainer.history.steps]
            for key in ["step", "loss", "lr", *[f"acc_{j}" for j in range(k)], *[f"loss_{j}" for j in range(k)]]
        },
        "drafter_config": {**drafter.cfg.__dict__, "aux_layers": list(drafter.cfg.aux_layers)},
        "job": job.metadata,
    }
    atomic_write_json(out / "metrics.json", metrics)
    plot_curves(metrics["curves"], out / "curves.png", k)
    from eagle3_dagster.target import target_summary

    export_drafter(
        drafter,
        out / "export",
        job.serving_context,
        getattr(torch, job.export_dtype),
        extra_config={"eagle3_dagster_train": {"steps": trainer.step, **job.metadata}},
        target_architecture=target_summary(Path(job.target_dir))["text_architecture"],
        sglang_versions=list(job.sglang_versions) if job.sglang_versions else None,
    )
    return metrics


def plot_curves(curves: dict[str, list[float]], path: Path, ttt_steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(curves["step"], curves["loss"], label="weighted loss")
    ax_loss.set(xlabel="step", ylabel="forward KL", title="loss")
    for j in range(ttt_steps):
        ax_acc.plot(curves["step"], curves[f"acc_{j}"], label=f"acc_{j}")
    ax_acc.set(xlabel="step", ylabel="top-1 agreement", title="per-step accuracy", ylim=(0, 1))
    ax_acc.legend(fontsize="small")
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def summary_metadata(metrics: dict) -> dict:
    """The figures a reader compares, each named for what it was measured on.

    `heldout_*` are the final evaluation on the samples `train.eval_fraction` kept out of training;
    without held-out samples the same figures come from training batches and are named
    `train_batches_*` (they flatter the drafter). `last_step_train_loss` is the loss of the last
    optimizer step's own batches (the end of the loss curve), not an evaluation."""
    f = metrics.get("final_eval") or metrics["final"]
    scope = f.get("scope", "train_batches")
    prefix = "heldout" if scope == "heldout" else "train_batches"
    out = {
        "steps": metrics["steps"],
        "tokens_per_s": round(float(metrics["tokens_per_s"]), 1),
        "eval_scope": scope,
        f"{prefix}_loss": round(float(f["loss"]), 5),
        f"{prefix}_sim_accept_length": round(float(f["sim_accept_length"]), 4),
        **{f"{prefix}_{k}": round(float(v), 4) for k, v in f.items() if k.startswith("acc_")},
    }
    if scope == "heldout":
        out |= {"heldout_samples": f.get("num_samples"), "heldout_scored_tokens": f.get("num_scored_tokens")}
    initial = metrics.get("initial_eval") or {}
    if "acc_0" in initial:
        out["untrained_acc_0"] = round(float(initial["acc_0"]), 4)  # same samples, before the first step
    losses = (metrics.get("curves") or {}).get("loss") or []
    if losses:
        out["last_step_train_loss"] = round(float(losses[-1]), 5)
    return out
