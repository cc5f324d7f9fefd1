"""The torchrun worker: `torchrun --nproc-per-node N -m eagle3_dagster.train --config job.json`.

One entry point, `main` (what `python -m eagle3_dagster.train` and the Pipes child run).

Builds the drafter from the job's explicit inputs, sets aside the held-out
samples (`train.eval_fraction`, chosen by sample id), resumes from the latest
checkpoint if there is one, trains on the rest, evaluates on the held-out
samples before and after, and on rank 0 writes `metrics.json`,
`curves.png` and the SGLang/vLLM export. Given a `Reporter` (Dagster's Pipes
child, `resources/pipes_child.py`, supplies one) rank 0 streams per-step
metrics to it and reports the final metrics; without one it shows a tqdm bar. `--stop-after-step N`
exits the process abruptly (os._exit) after step N, the way a killed run does. Under torchrun a worker
dies with its agent (`die_with_launcher`), so a torchrun killed outright leaves no rank behind.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Protocol
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_dagster.drafter.target_head import load_target_tensors
from eagle3_dagster.io import atomic_write_json
from eagle3_dagster.progress import ProgressMeter
from eagle3_dagster.train import TrainJobConfig
from eagle3_dagster.train.checkpoint import Checkpointer
from eagle3_dagster.train.data import split_heldout
from eagle3_dagster.train.schedule import BucketedSampler, train_schedule
from eagle3_dagster.train.loop import LoopConfig, Trainer, TTTObjective
from eagle3_dagster.train.outputs import summary_metadata, write_outputs


def _init_distributed(backend: str) -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    use_cuda = backend == "nccl" and torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return rank, world, device


def _load_dataset(job: TrainJobConfig):
    from eagle3_dagster.hidden.dataset import HiddenStatesDataset

    return HiddenStatesDataset(job.hidden_version_dir)  # a local folder or an object-store URL


def build_drafter(job: TrainJobConfig, dataset) -> tuple[Eagle3Drafter, torch.Tensor]:
    """The drafter (seeded init, target embedding) and the target lm_head for the teacher."""
    target = load_target_tensors(Path(job.target_dir), want=("embed", "lm_head"))
    mapping = load_file(job.vocab_mapping)
    if "d2t" not in mapping or "t2d" not in mapping:
        raise KeyError(f"{job.vocab_mapping}: vocab mapping needs tensors 'd2t' and 't2d', has {sorted(mapping)}")
    aux = job.aux_layers or tuple((getattr(dataset, "metadata", None) or {}).get("aux_layers") or ())
    if len(aux) != 3:
        raise ValueError(
            f"{job.hidden_version_dir}: aux layers unknown (job.aux_layers or metadata['aux_layers']): {aux}"
        )
    cfg = DrafterConfig.from_profile(
        job.drafter,
        target.arch,
        draft_vocab_size=int(mapping["d2t"].shape[0]),
        aux_layers=aux,
        serving_context=job.serving_context,
    )
    torch.manual_seed(job.train.seed)
    assert target.embed is not None and target.lm_head is not None  # both asked for: a missing one raised
    drafter = Eagle3Drafter(cfg, target.embed.float(), mapping["d2t"], mapping["t2d"])
    return drafter, target.lm_head


class Reporter(Protocol):
    """Where rank 0 sends progress lines and the final metrics (the run log, under Dagster)."""

    def log(self, line: str) -> None: ...

    def report(self, metadata: dict) -> None: ...


def run(job: TrainJobConfig, stop_after_step: int | None = None, reporter: Reporter | None = None) -> dict | None:
    rank, world, device = _init_distributed(job.train.backend)
    reporter = reporter if rank == 0 else None
    out = Path(job.out_dir)
    dataset = _load_dataset(job)
    drafter, lm_head = build_drafter(job, dataset)
    drafter.to(device)
    # held-out samples (by id, the same for every recipe) are evaluated after training, never trained on
    train_set, heldout = split_heldout(dataset, dataset.sample_ids, job.train.eval_fraction)
    sampler = BucketedSampler(train_set.lengths(), job.train.batch_tokens, rank, world, job.train.seed)
    schedule = train_schedule(dataset.lengths(), dataset.sample_ids, job.train, world)
    if schedule.total_steps < 1:
        raise ValueError(f"{len(sampler)} batches per rank give no optimizer step at grad_accum {job.train.grad_accum}")
    total = schedule.total_steps
    loop_cfg = LoopConfig(
        ttt_steps=job.train.ttt_steps,
        lr=job.train.lr,
        total_steps=total,
        warmup_steps=schedule.warmup_steps,
        grad_accum=job.train.grad_accum,
        grad_clip=job.train.grad_clip,
        eval_batches=job.eval_batches,
        betas=job.train.betas,
    )
    lk = (job.train.lk_kl_scale, job.train.lk_kl_decay) if job.train.loss == "lk_lambda" else None
    objective: torch.nn.Module = TTTObjective(drafter, lm_head.to(device), job.train.ttt_steps, lk=lk).to(device)
    if world > 1:
        # buffers (vocab map, target lm_head) are identical on every rank: DDP syncs them once at init, never
        # per step (torch 2.13's forward_sync_buffers; its deprecated broadcast_buffers=False warned on every run)
        objective = torch.nn.parallel.DistributedDataParallel(
            objective, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False
        )
    checkpointer = Checkpointer(out / "ckpt", job.train.checkpoint_every, rank)

    progress = None
    if rank == 0 and reporter is None:
        from tqdm import tqdm

        progress = tqdm(total=total, desc="train", file=sys.stderr)

    meter = ProgressMeter(reporter.log, "train", "steps", total) if reporter is not None else None

    def on_step(step: int, m: dict[str, float]) -> None:
        if rank != 0:
            return
        if meter is not None:
            meter.update(step, note=f"loss {m['loss']:.4f} acc_0 {m['acc_0']:.3f} lr {m['lr']:.2e}")
        elif progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{m['loss']:.3f}", acc0=f"{m['acc_0']:.3f}")

    trainer = Trainer(objective, drafter, train_set, sampler, loop_cfg, checkpointer, device, on_step)
    resumed = trainer.resume_if_possible()
    if meter is not None:
        meter.initial = meter.done = trainer.step
    if resumed and progress is not None:
        progress.update(trainer.step)
    initial = trainer.evaluate(heldout) if not resumed else None
    if initial is not None and rank == 0:
        atomic_write_json(out / "initial_eval.json", initial)
    timing = trainer.train(stop_after_step=stop_after_step)
    if stop_after_step is not None and trainer.step >= stop_after_step and trainer.step < total:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(17)  # the simulated crash: no cleanup, no final checkpoint, no export
    final = trainer.evaluate(heldout)
    if progress is not None:
        progress.close()
    metrics = None
    if rank == 0:
        metrics = write_outputs(job, trainer, drafter, final, timing, out)
        if reporter is not None:
            reporter.report(summary_metadata(metrics))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return metrics


def die_with_launcher() -> bool:
    """Have the kernel SIGKILL this worker when its parent, the torchrun agent, dies.

    torchrun starts each worker in a session of its own, so a torchrun killed outright (kill -9, the OOM
    killer) would leave its workers outside the process group the GPU host stops (and, over ssh, holding the
    session open); with the parent-death signal they end with it. Linux only: False elsewhere."""
    import ctypes
    import signal

    parent = os.getppid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    pr_set_pdeathsig = 1  # <sys/prctl.h>
    if prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the agent died before the call: the signal will never come
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def main(argv: list[str] | None = None, reporter: Reporter | None = None) -> None:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker torchrun started
        die_with_launcher()
    parser = argparse.ArgumentParser(prog="python -m eagle3_dagster.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="TrainJobConfig JSON file")
    parser.add_argument("--stop-after-step", type=int, default=None, help="simulate a crash after this step")
    args = parser.parse_args(argv)
    run(TrainJobConfig.read(args.config), stop_after_step=args.stop_after_step, reporter=reporter)
