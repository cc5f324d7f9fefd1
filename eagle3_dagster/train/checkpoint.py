"""Training checkpoints that a killed run resumes from bit-exactly.

A checkpoint `ckpt/step_{N:07d}/` holds the trainable drafter weights
(`model.safetensors`), the optimizer state (`optimizer.pt`, tensors and plain
numbers only, loaded with `weights_only=True`), the scheduler, sampler
position and step (`trainer_state.json`) and every rank's RNG state
(`rng_rank{r}.pt`). Every rank writes into `step_N.tmp/`, then rank 0 renames
it into place and rewrites the `latest` pointer, so a kill at any moment leaves
either the previous checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from eagle3_dagster.io import atomic_write_json, atomic_write_text, naming_full_disk
from eagle3_dagster.storage import read_json

LATEST = "latest"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class Checkpointer:
    """Owns the checkpoint interval as well as the files (the loop only asks `maybe_save`)."""

    def __init__(self, root: Path, every: int, rank: int, keep: int = 2) -> None:
        self.root, self.every, self.rank, self.keep = Path(root), every, rank, keep

    def maybe_save(self, step: int, **parts) -> Path | None:
        if self.every > 0 and step % self.every == 0:
            return self.save(step, **parts)
        return None

    def save(
        self, step: int, *, model_state: dict[str, torch.Tensor], optimizer, scheduler, trainer_state: dict[str, Any]
    ) -> Path:
        final = self.root / f"step_{step:07d}"
        tmp = self.root / f"step_{step:07d}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        # torch.save reports a full disk as "RuntimeError: basic_ios::clear: iostream error", naming nothing
        with naming_full_disk(tmp / f"rng_rank{self.rank}.pt", unnamed_errors=(RuntimeError,)):
            torch.save(_rng_state(), tmp / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            with naming_full_disk(tmp / "model.safetensors", unnamed_errors=(SafetensorError,)):
                save_file(
                    {k: v.detach().cpu().contiguous() for k, v in model_state.items()}, str(tmp / "model.safetensors")
                )
            with naming_full_disk(tmp / "optimizer.pt", unnamed_errors=(RuntimeError,)):
                torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
            atomic_write_json(
                tmp / "trainer_state.json", {**trainer_state, "step": step, "scheduler": scheduler.state_dict()}
            )
        _barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            atomic_write_text(self.root / LATEST, final.name)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        done = sorted(p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        pointer = self.root / LATEST
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / "trainer_state.json").exists():
            raise FileNotFoundError(f"{pointer} names {path.name}, which is incomplete or missing")
        return path

    def load(self, path: Path, *, model: torch.nn.Module, optimizer, scheduler, device: torch.device) -> dict[str, Any]:
        """Restore everything in place; returns the trainer state (step, sampler, …)."""
        weights = load_file(str(path / "model.safetensors"), device=str(device))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [m for m in missing if not m.startswith("embed_tokens.")]
        if missing or unexpected:
            raise ValueError(
                f"{path}: checkpoint does not fit the drafter (missing {missing}, unexpected {unexpected})"
            )
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
        state = read_json(path / "trainer_state.json")
        scheduler.load_state_dict(state.pop("scheduler"))
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.exists():  # absent when resuming on more ranks than saved
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return state
