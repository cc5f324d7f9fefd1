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
    from eagle3_dagster.io import read_json

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
        "curves": {key: [h[key] for h in trainer.history.steps] for key in
                   ["step", "loss", "lr", *[f"acc_{j}" for j in range(k)], *[f"loss_{j}" for j in range(k)]]},
        "drafter_config": {**drafter.cfg.__dict__, "aux_layers": list(drafter.cfg.aux_layers)},
        "job": job.metadata,
    }
    atomic_write_json(out / "metrics.json", metrics)
    plot_curves(metrics["curves"], out / "curves.png", k)
    from eagle3_dagster.target import target_summary

    export_drafter(drafter, out / "export", job.serving_context, getattr(torch, job.export_dtype),
                   extra_config={"eagle3_dagster_train": {"steps": trainer.step, **job.metadata}},
                   target_architecture=target_summary(Path(job.target_dir))["text_architecture"],
                   sglang_versions=list(job.sglang_versions) if job.sglang_versions else None)
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
    f = metrics["final"]
    return {"steps": metrics["steps"], "tokens_per_s": round(metrics["tokens_per_s"], 1),
            "sim_accept_length": round(f["sim_accept_length"], 4), "final_loss": round(f["loss"], 5),
            **{k: round(v, 4) for k, v in f.items() if k.startswith("acc_")}}
