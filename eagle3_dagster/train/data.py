"""Length-bucketed, distributed, resumable batches over hidden-state samples.

Owns the order in which samples are trained on. The dataset is anything with
`__len__`, `__getitem__(i) -> {input_ids, loss_mask, aux_hidden, last_hidden,
sample_id}` and `lengths()` (`eagle3_dagster.hidden.shards.HiddenStatesDataset`
memory-maps its shards, so a batch reads only its own rows).

A batch is a few samples of similar length, right-padded to the longest, with
at most `batch_tokens` padded tokens (a sample longer than that is a batch on
its own). Right padding plus causal attention means real tokens never see
padding, so no attention mask is needed. The plan of an epoch is a pure
function of (lengths, seed, epoch), so the sampler's state is two integers
and a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

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
        bucket = sorted(order[s : s + BUCKET_SAMPLES].tolist(), key=lambda i: (lengths[i], i))
        current: list[int] = []
        for i in bucket:
            longest = max([lengths[j] for j in current] + [lengths[i]])
            if current and longest * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
    batches = [batches[i] for i in rng.permutation(len(batches))]
    usable = len(batches) - len(batches) % world_size
    return batches[:usable]


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
