"""Pre-training the tiny target on chat-rendered ShareGPT, so it is a real (small) language model.

Owns: packing token streams into fixed-length sequences, the training loop
(AdamW, linear warm-up then cosine decay, gradient clipping) and DeepSeek-V3's
auxiliary-loss-free expert balancing. It gets a built model and token streams;
reading data, the tokenizer and saving are `build.py`'s.

Deterministic for the same inputs, seed and thread count (CPU kernels).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from transformers import get_cosine_schedule_with_warmup
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from eagle3_dagster.progress import ProgressMeter

PROGRESS_EVERY_S = 5.0
LOSS_CURVE_POINTS = 200
# DeepSeek-V3 §2.1.2: after each step, nudge each expert's routing bias by this much
# towards balanced load (the bias only affects *which* experts are chosen, not their weights).
BIAS_UPDATE_SPEED = 1e-3


@dataclass(frozen=True)
class PretrainSettings:
    num_tokens: int
    seq_len: int
    batch_size: int
    lr: float
    seed: int
    warmup_ratio: float = 0.05
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    @property
    def num_steps(self) -> int:
        return max(1, math.ceil(self.num_tokens / (self.seq_len * self.batch_size)))


@dataclass
class PretrainResult:
    tokens_seen: int
    num_steps: int
    final_loss: float
    loss_curve: list[float]  # mean loss over equal windows of steps, at most LOSS_CURVE_POINTS points
    seconds: float
    expert_load_imbalance: float  # max/mean tokens per routed expert over the last step, worst layer
    step_losses: list[float] = field(repr=False, default_factory=list)


def pack_sequences(token_streams: Iterable[list[int]], seq_len: int, num_sequences: int) -> torch.Tensor:
    """Concatenate streams and cut into `[num_sequences, seq_len]`; cycles over the streams if they run short."""
    streams = token_streams if isinstance(token_streams, list) else list(token_streams)
    if not any(streams):
        raise ValueError("pack_sequences: no tokens to pack")
    need = seq_len * num_sequences
    flat: list[int] = []
    while len(flat) < need:
        for s in streams:
            flat.extend(s)
            if len(flat) >= need:
                break
    return torch.tensor(flat[:need], dtype=torch.long).view(num_sequences, seq_len)


class _ExpertLoadBalancer:
    """Counts routed tokens per expert via router hooks and applies the aux-free bias update."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.loads = [torch.zeros(r.num_experts) for r in self.routers]
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int):
        def record(_module, _inputs, outputs) -> None:
            topk_indices = outputs[2]
            self.loads[i] += torch.bincount(topk_indices.flatten(), minlength=self.loads[i].numel()).float()

        return record

    @torch.no_grad()
    def step(self) -> float:
        worst = 1.0
        for router, load in zip(self.routers, self.loads):
            if load.sum() > 0:
                bias = router.e_score_correction_bias
                assert isinstance(bias, torch.Tensor)  # the router's buffer, updated in place
                bias.sub_(BIAS_UPDATE_SPEED * torch.sign(load - load.mean()))
                worst = max(worst, float(load.max() / load.mean()))
            load.zero_()
        return worst

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def pretrain(
    model: torch.nn.Module,
    sequences_NT: torch.Tensor,
    settings: PretrainSettings,
    *,
    progress: Callable[[str], None] | None = None,
) -> PretrainResult:
    """Next-token training over `sequences_NT` in a seeded shuffled order, `settings.num_steps` steps."""
    torch.manual_seed(settings.seed)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "gate.weight" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "gate.weight" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    steps = settings.num_steps
    scheduler = get_cosine_schedule_with_warmup(optimizer, max(1, int(settings.warmup_ratio * steps)), steps)
    order = torch.randperm(sequences_NT.shape[0], generator=torch.Generator().manual_seed(settings.seed))
    balancer = _ExpertLoadBalancer(model)
    losses: list[float] = []
    imbalance = 1.0
    started = time.monotonic()
    tokens = 0
    meter = ProgressMeter(progress, "pretrain", "steps", steps, every_s=PROGRESS_EVERY_S) if progress else None
    try:
        for step in range(steps):
            rows = order[(torch.arange(settings.batch_size) + step * settings.batch_size) % len(order)]
            batch_BT = sequences_NT[rows]
            loss = model(input_ids=batch_BT, labels=batch_BT).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            imbalance = balancer.step()
            tokens += batch_BT.numel()
            losses.append(loss.item())
            if meter is not None:
                meter.update(
                    step + 1, note=f"loss {losses[-1]:.3f}, {tokens / (time.monotonic() - started):,.0f} tokens/s"
                )
    finally:
        balancer.close()
    model.eval()
    tail = losses[-max(1, min(20, len(losses) // 10)) :]
    return PretrainResult(
        tokens_seen=tokens,
        num_steps=steps,
        final_loss=sum(tail) / len(tail),
        loss_curve=downsample(losses, LOSS_CURVE_POINTS),
        seconds=time.monotonic() - started,
        expert_load_imbalance=imbalance,
        step_losses=losses,
    )


def downsample(values: list[float], points: int) -> list[float]:
    """Window means, so a long curve stays readable in metadata without hiding its trend."""
    if len(values) <= points:
        return list(values)
    edges = [round(i * len(values) / points) for i in range(points + 1)]
    return [sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:])]
