"""The training loop: TTT loss under DDP, accumulation, schedule, clipping, metrics.

The loop reads like torchtitan's `Trainer.train`: the checkpointer owns its
interval, the metrics sink owns how progress is shown (tqdm or Dagster Pipes);
the loop only steps. `TTTObjective` is the module DDP wraps, so gradient
all-reduce hooks see one forward per micro-batch.

A non-finite loss or gradient stops training at that step, before the optimizer
applies it and before any checkpoint: every rank raises `NonFiniteTrainingError`
naming the step and the sample ids of the batches whose loss was not finite (the
ids are gathered from every rank, so the message is the same on each).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from eagle3_dagster.drafter.loss import acceptance_length, build_teacher, draft_rows, step_weights, ttt_loss
from eagle3_dagster.drafter.model import Eagle3Drafter
from eagle3_dagster.drafter.ttt import RECOMPUTE_MLP_FROM_TOKENS, ttt_unroll
from eagle3_dagster.train.checkpoint import Checkpointer
from eagle3_dagster.train.data import Batch, HiddenSamples, collate
from eagle3_dagster.train.schedule import BucketedSampler, eval_batches


class NonFiniteTrainingError(FloatingPointError):
    """A step whose loss or gradient norm is NaN or infinite; nothing of that step was applied."""


class TTTObjective(nn.Module):
    """Drafter + frozen teacher head; forward returns the weighted loss and per-step counts [k, 3]."""

    target_lm_head: torch.Tensor  # buffers, registered in __init__
    teacher_head: torch.Tensor

    def __init__(
        self,
        drafter: Eagle3Drafter,
        target_lm_head_VH: torch.Tensor,
        ttt_steps: int,
        lk: tuple[float, float] | None = None,
    ) -> None:
        super().__init__()
        self.drafter = drafter
        self.register_buffer("target_lm_head", target_lm_head_VH, persistent=False)
        # the teacher's draft-vocab rows, sliced once instead of per batch
        self.register_buffer("teacher_head", draft_rows(target_lm_head_VH, drafter.t2d), persistent=False)
        self.ttt_steps = ttt_steps
        self.weights = step_weights(ttt_steps)
        self.lk = lk  # (kl_scale, kl_decay) of the LK lambda objective; None: plain forward KL

    def forward(self, input_ids_BT, loss_mask_BT, aux_hidden_BT3H, last_hidden_BTH):
        teacher = build_teacher(
            last_hidden_BTH, loss_mask_BT, self.target_lm_head, self.drafter.t2d, draft_head_VdH=self.teacher_head
        )
        normed = list(ttt_unroll(self.drafter, input_ids_BT, aux_hidden_BT3H, self.ttt_steps))
        return ttt_loss(normed, self.drafter.lm_head.weight, teacher, self.weights, lk=self.lk)


@dataclass(frozen=True)
class LoopConfig:
    ttt_steps: int
    lr: float
    total_steps: int
    warmup_steps: int
    grad_accum: int
    grad_clip: float
    eval_batches: int = 4
    betas: tuple[float, float] = (0.9, 0.95)


def cosine_with_warmup(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


def summarize(stats_K3: torch.Tensor) -> dict[str, float]:
    """Per-step loss/acc from summed (kl_sum, num_valid, num_correct), and the simulated acceptance length."""
    out: dict[str, float] = {}
    accs = []
    for j, (kl, n, c) in enumerate(stats_K3.tolist()):
        out[f"loss_{j}"] = kl / max(n, 1)
        out[f"acc_{j}"] = c / max(n, 1)
        accs.append(out[f"acc_{j}"])
    out["loss"] = sum(w * out[f"loss_{j}"] for j, w in enumerate(step_weights(len(accs))))
    out["sim_accept_length"] = acceptance_length(accs, bonus=True)
    out["sim_accept_length_no_bonus"] = acceptance_length(accs, bonus=False)
    return out


@dataclass
class History:
    steps: list[dict[str, float]] = field(default_factory=list)


# glibc's mmap threshold for CPU training (see `return_freed_cpu_memory`): measured with
# benchmarks/ttt_step.py's shapes, 4 MiB keeps 8k-token peaks as low as 1 MiB did (1.36 GB) for a quarter
# of the page-fault time at 1k tokens; 16 MiB lets the peak back up to 2.1 GB.
MMAP_THRESHOLD_BYTES = 4 << 20
# Below this many tokens per micro-batch a step's peak is well under a GB and compute bounds the step:
# the allocator is left alone (its page faults would cost ~10% there). The same length as
# `ttt.RECOMPUTE_MLP_FROM_TOKENS`, where memory starts to bound the step.
RETURN_MEMORY_FROM_TOKENS = RECOMPUTE_MLP_FROM_TOKENS


def return_freed_cpu_memory(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Make glibc hand freed blocks of `threshold_bytes` or more straight back to the OS (CPU training).

    glibc raises its mmap threshold to the size of each freed mmapped block (up to 32 MiB), so after
    the first step a TTT step's many 8–32 MiB activations come from the heap, whose freed holes
    stay resident: peak RSS at 8k tokens was ~1.5× the live tensors (benchmarks/ttt_step.py).
    A fixed threshold (what MALLOC_MMAP_THRESHOLD_ sets) stops that, at the price of a page fault
    on every fresh page of a block above it. Returns False where there is no glibc (then nothing
    changes).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    m_mmap_threshold = -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, int(threshold_bytes)))


def tune_cpu_allocator(max_micro_batch_tokens: int) -> bool:
    """What Trainer does on CPU: return freed memory only where memory, not compute, bounds a step."""
    if max_micro_batch_tokens < RETURN_MEMORY_FROM_TOKENS:
        return False
    return return_freed_cpu_memory()


class Trainer:
    def __init__(
        self,
        objective: nn.Module,
        drafter: Eagle3Drafter,
        dataset: HiddenSamples,
        sampler: BucketedSampler,
        cfg: LoopConfig,
        checkpointer: Checkpointer,
        device: torch.device,
        on_step: Callable[[int, dict[str, float]], None] = lambda step, m: None,
    ) -> None:
        self.objective, self.drafter, self.dataset, self.sampler = objective, drafter, dataset, sampler
        self.cfg, self.checkpointer, self.device, self.on_step = cfg, checkpointer, device, on_step
        params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_with_warmup(cfg.warmup_steps, cfg.total_steps)
        )
        self.step = 0
        self.tokens_seen = 0
        self.history = History()
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
        if device.type == "cpu":
            tune_cpu_allocator(max([sampler.batch_tokens, *sampler.lengths]))

    def resume_if_possible(self) -> bool:
        path = self.checkpointer.latest()
        if path is None:
            return False
        state = self.checkpointer.load(
            path, model=self.drafter, optimizer=self.optimizer, scheduler=self.scheduler, device=self.device
        )
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.sampler.load_state_dict(state["sampler"])
        self.history.steps = list(state.get("history", []))
        return True

    def _micro_batch(self, batch: Batch, sync: bool) -> tuple[torch.Tensor, float]:
        b = batch.to(self.device)
        no_sync = getattr(self.objective, "no_sync", None)  # DDP's: accumulate without an all-reduce
        with no_sync() if (not sync and no_sync is not None) else nullcontext():
            with self.autocast:
                loss, stats = self.objective(b.input_ids_BT, b.loss_mask_BT, b.aux_hidden_BT3H, b.last_hidden_BTH)
            (loss / self.cfg.grad_accum).backward()
        return stats, float(loss.detach())

    def train_step(self) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        stats = torch.zeros(self.cfg.ttt_steps, 3, dtype=torch.float64)
        tokens = 0
        bad_batches: list[tuple[float, list[str]]] = []
        for micro in range(self.cfg.grad_accum):
            batch = collate(self.dataset, self.sampler.next_batch())
            micro_stats, loss = self._micro_batch(batch, sync=micro == self.cfg.grad_accum - 1)
            stats += micro_stats
            tokens += batch.num_tokens
            if not math.isfinite(loss):
                bad_batches.append((loss, batch.sample_ids))
        # one collective for the metrics, the token count and how many batches had a non-finite loss
        totals = _all_reduce(
            torch.cat([stats.flatten(), torch.tensor([float(tokens), float(len(bad_batches))], dtype=torch.float64)])
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self._stop_if_not_finite(int(totals[-1]), bad_batches, float(grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        self.tokens_seen += int(totals[-2])
        metrics = summarize(totals[:-2].view(-1, 3))
        metrics.update(
            grad_norm=float(grad_norm), lr=float(self.scheduler.get_last_lr()[0]), step_tokens=int(totals[-2])
        )
        return metrics

    def _stop_if_not_finite(self, num_bad: int, bad_batches: list[tuple[float, list[str]]], grad_norm: float) -> None:
        """Raise on every rank when any rank's loss, or the (all-reduced, so shared) gradient norm, is not finite."""
        if num_bad == 0 and math.isfinite(grad_norm):
            return
        everyone: list = [bad_batches]
        if dist.is_available() and dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, bad_batches)
        found = [(rank, loss, ids) for rank, batches in enumerate(everyone) for loss, ids in batches]
        step = self.step + 1
        if found:
            detail = "; ".join(f"rank {r} loss {loss} on samples {ids}" for r, loss, ids in found)
        else:
            detail = "every loss was finite, the gradient was not"
        raise NonFiniteTrainingError(
            f"training stopped at step {step}: non-finite loss or gradient (grad norm {grad_norm}); {detail}. "
            f"Nothing of step {step} was applied or checkpointed; check those samples' hidden states "
            f"(hidden_states checks) or lower train.lr"
        )

    @torch.no_grad()
    def evaluate(self, heldout: HiddenSamples | None = None) -> dict[str, float | int | str | None]:
        """Metrics over every sample of `heldout` (split over the ranks), or, without held-out samples,
        over the first `eval_batches` training batches of epoch 0 on every rank (a fixed set, same each call).
        `scope` says which: a training-batch figure flatters the drafter."""
        stats = torch.zeros(self.cfg.ttt_steps, 3, dtype=torch.float64)
        rank, world = self.sampler.rank, self.sampler.world_size
        if heldout is not None and len(heldout):
            source, plan = heldout, eval_batches(heldout.lengths(), self.sampler.batch_tokens, rank, world)
        else:
            source, plan = self.dataset, self.sampler.batches_for(0)[: self.cfg.eval_batches]
        # the bare objective: evaluation issues no DDP collective, so ranks may hold different batch counts
        objective = getattr(self.objective, "module", self.objective)
        for indices in plan:
            b = collate(source, indices).to(self.device)
            with self.autocast:
                _, s = objective(b.input_ids_BT, b.loss_mask_BT, b.aux_hidden_BT3H, b.last_hidden_BTH)
            stats += s
        out: dict[str, float | int | str | None] = dict(summarize(_all_reduce(stats)))
        out["scope"] = "heldout" if source is heldout else "train_batches"
        out["num_samples"] = len(heldout) if source is heldout else None
        out["num_scored_tokens"] = int(stats[0, 1])  # teacher rows scored at TTT step 0
        return out

    def train(self, stop_after_step: int | None = None) -> dict[str, float]:
        t0, tokens0 = time.perf_counter(), self.tokens_seen
        while self.step < self.cfg.total_steps:
            metrics = self.train_step()
            self.history.steps.append({"step": self.step, **metrics})
            self.on_step(self.step, metrics)
            self.checkpointer.maybe_save(
                self.step,
                model_state=self.drafter.trainable_state_dict(),
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                trainer_state={
                    "sampler": self.sampler.state_dict(),
                    "tokens_seen": self.tokens_seen,
                    "history": self.history.steps,
                },
            )
            if stop_after_step is not None and self.step >= stop_after_step:
                break
        elapsed = time.perf_counter() - t0
        return {"tokens_per_s": (self.tokens_seen - tokens0) / max(elapsed, 1e-9), "train_seconds": elapsed}
