"""Length-bucketed, distributed, resumable batches over hidden-state samples.

Owns the order in which samples are trained on. The dataset is anything with
`__len__`, `__getitem__(i) -> {input_ids, loss_mask, aux_hidden, last_hidden,
sample_id}` and `lengths()` (`eagle3_dagster.hidden.dataset.HiddenStatesDataset`
memory-maps its shards, so a batch reads only its own rows).

A batch is a few samples of similar length, right-padded to the longest, with
at most `batch_tokens` padded tokens (a sample longer than that is a batch on
its own). Right padding plus causal attention means real tokens never see
padding, so no attention mask is needed. The plan of an epoch is a pure
function of (lengths, seed, epoch), so the sampler's state is two integers
and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

BUCKET_SAMPLES = 256  # samples sorted together: larger = less padding, less randomness


class HiddenSamples(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    def lengths(self) -> list[int]: ...


def plan_epoch(lengths: list[int], batch_tokens: int, seed: int, epoch: int, world_size: int) -> list[list[int]]:
    """Every batch of one epoch (all ranks), a multiple of world_size long so DDP ranks step together."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    batches: list[list[int]] = []
    for s in range(0, len(order), BUCKET_SAMPLES):
        batches += _pack(sorted(order[s : s + BUCKET_SAMPLES].tolist(), key=lambda i: (lengths[i], i)),
                         lengths, batch_tokens)
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


class SampleSubset(torch.utils.data.Subset):
    """torch's `Subset` plus the `lengths()` the sampler needs."""

    def lengths(self) -> list[int]:
        every = self.dataset.lengths()
        return [every[i] for i in self.indices]


def split_heldout(dataset: HiddenSamples, sample_ids: Sequence[str], fraction: float) -> tuple[SampleSubset, SampleSubset]:
    """(train, held-out) subsets of `dataset` by `is_heldout_sample`; the held-out part is never trained on."""
    held = [i for i, sid in enumerate(sample_ids) if is_heldout_sample(sid, fraction)]
    held_set = set(held)
    train = [i for i in range(len(sample_ids)) if i not in held_set]
    if not train:
        raise ValueError(f"train.eval_fraction {fraction} holds out all {len(sample_ids)} samples; lower it")
    return SampleSubset(dataset, train), SampleSubset(dataset, held)


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
        return (f"{self.total_steps:,} optimizer steps ({self.steps_per_epoch:,} per epoch, {self.warmup_steps:,} "
                f"warm-up), {self.tokens_per_step:,.0f} tokens per step over {self.world_size} rank(s); "
                f"{self.num_train_samples:,} samples trained on, {self.num_heldout_samples:,} held out")


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
        num_train_samples=len(kept), num_heldout_samples=len(held) - len(kept), world_size=world_size,
        batches_per_rank_per_epoch=per_rank, steps_per_epoch=per_epoch, total_steps=total,
        warmup_steps=max(1, math.ceil(train.warmup_ratio * total)),
        tokens_per_step=tokens / max(per_epoch, 1) if per_epoch else 0.0)


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
        return plan_epoch(self.lengths, self.batch_tokens, self.seed, epoch, self.world_size)[self.rank :: self.world_size]

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


@dataclass
class Batch:
    input_ids_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    aux_hidden_BT3H: torch.Tensor
    last_hidden_BTH: torch.Tensor
    num_tokens: int  # real (unpadded) tokens
    sample_ids: list[str]

    def to(self, device: torch.device) -> "Batch":
        move = lambda x: x.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.input_ids_BT), move(self.loss_mask_BT), move(self.aux_hidden_BT3H),
                     move(self.last_hidden_BTH), self.num_tokens, self.sample_ids)


def collate(dataset: HiddenSamples, indices: list[int], dtype: torch.dtype = torch.float32) -> Batch:
    samples = [dataset[i] for i in indices]
    for idx, s in zip(indices, samples):
        t = len(s["input_ids"])
        for key in ("loss_mask", "aux_hidden", "last_hidden"):
            if s[key].shape[0] != t:
                raise ValueError(f"sample {s.get('sample_id', idx)}: {key} has {s[key].shape[0]} rows, input_ids has {t}")
        if s["aux_hidden"].shape[-1] != 3 * s["last_hidden"].shape[-1]:
            raise ValueError(f"sample {s.get('sample_id', idx)}: aux_hidden width is not 3 × hidden size")
    t_max = max(len(s["input_ids"]) for s in samples)
    b, h = len(samples), samples[0]["last_hidden"].shape[-1]
    ids = torch.zeros(b, t_max, dtype=torch.long)
    mask = torch.zeros(b, t_max, dtype=torch.long)
    aux = torch.zeros(b, t_max, 3 * h, dtype=dtype)
    last = torch.zeros(b, t_max, h, dtype=dtype)
    for r, s in enumerate(samples):
        t = len(s["input_ids"])
        ids[r, :t] = torch.as_tensor(s["input_ids"])
        mask[r, :t] = torch.as_tensor(s["loss_mask"])
        aux[r, :t] = torch.as_tensor(s["aux_hidden"]).to(dtype)
        last[r, :t] = torch.as_tensor(s["last_hidden"]).to(dtype)
    return Batch(ids, mask, aux, last, sum(len(s["input_ids"]) for s in samples),
                 [str(s.get("sample_id", i)) for i, s in zip(indices, samples)])
