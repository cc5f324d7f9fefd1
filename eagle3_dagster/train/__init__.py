"""Drafter training: the job description the Dagster asset writes, and the torchrun command that runs it.

`TrainJobConfig` is a frozen, JSON-serializable description of one training
run (explicit upstream paths, architecture overrides, hyperparameters); the
asset writes it to a file and launches `build_torchrun_command(...)` through
Dagster Pipes. The workers (`python -m eagle3_dagster.train`) read it back.
Data order and the step count are in schedule.py, batches as tensors in data.py,
checkpoints in checkpoint.py, the loop in loop.py, the worker process in worker.py;
each node's command on several hosts in nodes.py.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagle3_dagster.config import DrafterOverrides
from eagle3_dagster.config import TrainConfig
from eagle3_dagster.sglang_releases import EAGLE31_OPTIONS


@dataclass(frozen=True)
class TrainJobConfig:
    hidden_version_dir: str  # one hidden-states version (all its shards)
    target_dir: str  # the target model directory (embedding + lm_head are read from it)
    vocab_mapping: str  # safetensors with d2t / t2d
    out_dir: str  # checkpoints, metrics.json, curves.png, export/
    serving_context: int  # the export's max_position_embeddings floor
    train: TrainConfig = field(default_factory=TrainConfig)
    drafter: DrafterOverrides = field(default_factory=DrafterOverrides)
    aux_layers: tuple[int, ...] | None = None  # canonical; default: the dataset metadata's `aux_layers`
    export_dtype: str = "bfloat16"
    sglang_versions: tuple[str, ...] | None = None  # the export's aux ids are written for these (None: all that can)
    eval_batches: int = 4
    metadata: dict = field(default_factory=dict)  # provenance copied into metrics.json and the export config

    def to_json(self) -> str:
        d = asdict(self)
        d["train"] = self.train.model_dump()
        # The EAGLE 3.1 switches are written only when on: the job's JSON names the run folder (its hash), and
        # a run trained before they existed is then found again, not trained twice.
        d["drafter"] = self.drafter.model_dump(exclude={k for k in EAGLE31_OPTIONS if not getattr(self.drafter, k)})
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainJobConfig":
        d = json.loads(text)
        d["train"] = TrainConfig.model_validate(d.get("train") or {})
        d["drafter"] = DrafterOverrides.model_validate(d.get("drafter") or {})
        if d.get("aux_layers") is not None:
            d["aux_layers"] = tuple(d["aux_layers"])
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"train job config: {e}") from None

    def write(self, path: Path) -> Path:
        from eagle3_dagster.io import atomic_write_text

        atomic_write_text(path, self.to_json())
        return Path(path)

    @classmethod
    def read(cls, path: Path) -> "TrainJobConfig":
        return cls.from_json(Path(path).read_text())


def build_torchrun_command(
    job_cfg_path: Path,
    nproc_per_node: int,
    nnodes: int = 1,
    python: str = sys.executable,
    extra_args: tuple[str, ...] | list[str] = (),
    module: str = "eagle3_dagster.train",
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "eagle3-drafter",
) -> list[str]:
    """`python -m torch.distributed.run ... -m eagle3_dagster.train --config <json>`.

    With `rdzv_endpoint` every node joins torchrun's c10d rendezvous there (node 0 hosts it; the same command
    runs on each node, which then share one job file on a common file system); without it a single node
    uses `--standalone`. `extra_args` go to torchrun before the module; running torchrun through
    `python -m` pins the interpreter explicitly.
    `module` is the worker: the engine's own, or a wrapper with the same arguments (the Dagster Pipes
    child in resources/pipes_child.py).
    """
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}"]
    if rdzv_endpoint:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    elif nnodes == 1:
        cmd.append("--standalone")
    else:
        raise ValueError(f"torchrun over {nnodes} nodes needs a rendezvous endpoint (train.rdzv_endpoint)")
    cmd += [*extra_args, "-m", module, "--config", str(job_cfg_path)]
    return cmd


__all__ = ["TrainJobConfig", "build_torchrun_command"]
