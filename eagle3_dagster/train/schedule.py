"""Which samples each rank trains on, in what order, and how many optimizer steps that makes.

Owns the order in which samples are trained on. A batch is a few samples of
similar length, right-padded to the longest, with at most `batch_tokens` padded
tokens (a sample longer than that is a batch on its own). The plan of an epoch is
a pure function of (lengths, seed, epoch), so the sampler's state is two integers
and a resumed run sees exactly the batches it would have seen. A sample is held
out of training by its id alone (`is_heldout_sample`).

Indices and lengths only, no tensors: `eagle3 plan` and the extraction_plan step
compute the training schedule (`train_schedule`) without importing torch (~2 s).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

BUCKET_SAMPLES = 256  # samples sorted together: larger = less padding, less randomness


def plan_epoch(lengths: list[int], batch_tokens: int, seed: int, epoch: int, world_size: int) -> list[list[int]]:
    """Every batch of one epoch (all ranks), a multiple of world_size long so DDP ranks step together."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    batches: list[list[int]] = []
    for s in range(0, len(order), BUCKET_SAMPLES):
        batches += _pack(
            sorted(order[s : s + BUCKET_SAMPLES].tolist(), key=lambda i: (lengths[i], i)), lengths, batch_tokens
        )
    batches = [batches[i] for i in rng.permutation(len(batches))]
    usable = len(batches) - len(batches) % world_size
    return batches[:usable]


def _pack(indices: Sequence[int], lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive runs of `indices` whose padded size (longest × count) stays within `batch_tokens`."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in indices:
        longest = max([lengths[j] for j in current] + [lengths[i]])
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def is_heldout_sample(sample_id: str, fraction: float) -> bool:
    """Whether a sample is kept out of training: a pure function of its id (sha256), so every recipe,
    seed and world size holds out the same samples, and a sample's fate never depends on its neighbours."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"eagle3-heldout:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def eval_batches(lengths: Sequence[int], batch_tokens: int, rank: int, world_size: int) -> list[list[int]]:
    """Every sample exactly once, in length order, packed to `batch_tokens`, dealt round-robin to the ranks
    (their counts may differ by one: evaluation runs no collective per batch)."""
    return _pack(sorted(range(len(lengths)), key=lambda i: (lengths[i], i)), lengths, batch_tokens)[rank::world_size]


@dataclass(frozen=True)
class TrainSchedule:
    """How many optimizer steps a recipe makes of a corpus: what `eagle3 plan` prints and the worker runs."""

    num_train_samples: int
    num_heldout_samples: int
    world_size: int
    batches_per_rank_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    tokens_per_step: float  # real (unpadded) tokens per optimizer step, all ranks, epoch 0's mean

    def describe(self) -> str:
        return (
            f"{self.total_steps:,} optimizer steps ({self.steps_per_epoch:,} per epoch, {self.warmup_steps:,} "
            f"warm-up), {self.tokens_per_step:,.0f} tokens per step over {self.world_size} rank(s); "
            f"{self.num_train_samples:,} samples trained on, {self.num_heldout_samples:,} held out"
        )


def train_schedule(lengths: Sequence[int], sample_ids: Sequence[str], train: Any, world_size: int) -> TrainSchedule:
    """The schedule of `train` (a `TrainConfig`) over samples of these lengths and ids on `world_size` ranks."""
    import math

    held = [is_heldout_sample(sid, train.eval_fraction) for sid in sample_ids]
    kept = [n for n, h in zip(lengths, held) if not h]
    batches = plan_epoch(kept, train.batch_tokens, train.seed, 0, world_size)
    per_rank = len(batches) // world_size
    per_epoch = per_rank // train.grad_accum
    total = train.max_steps or train.epochs * per_epoch
    tokens = sum(kept[i] for b in batches for i in b)
    return TrainSchedule(
        num_train_samples=len(kept),
        num_heldout_samples=len(held) - len(kept),
        world_size=world_size,
        batches_per_rank_per_epoch=per_rank,
        steps_per_epoch=per_epoch,
        total_steps=total,
        warmup_steps=max(1, math.ceil(train.warmup_ratio * total)),
        tokens_per_step=tokens / max(per_epoch, 1) if per_epoch else 0.0,
    )


class BucketedSampler:
    """Yields this rank's batches (lists of sample indices) from (epoch, position), across epochs."""

    def __init__(self, lengths: list[int], batch_tokens: int, rank: int, world_size: int, seed: int) -> None:
        if not lengths:
            raise ValueError("training dataset is empty")
        self.lengths, self.batch_tokens = list(lengths), batch_tokens
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch, self.position = 0, 0
        if not self.batches_for(0):
            raise ValueError(
                f"{len(lengths)} samples make fewer batches than the {world_size} ranks; lower train.batch_tokens"
            )

    def batches_for(self, epoch: int) -> list[list[int]]:
        return plan_epoch(self.lengths, self.batch_tokens, self.seed, epoch, self.world_size)[
            self.rank :: self.world_size
        ]

    def __len__(self) -> int:
        """Batches per rank per epoch."""
        return len(self.batches_for(0))

    def next_batch(self) -> list[int]:
        batches = self.batches_for(self.epoch)
        if self.position >= len(batches):
            self.epoch, self.position = self.epoch + 1, 0
            batches = self.batches_for(self.epoch)
        batch = batches[self.position]
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
