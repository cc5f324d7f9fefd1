"""Batches of hidden-state samples as tensors: the held-out split and the padded batch.

The dataset is anything with `__len__`, `__getitem__(i) -> {input_ids, loss_mask,
aux_hidden, last_hidden, sample_id}` and `lengths()`
(`eagle3_dagster.hidden.dataset.HiddenStatesDataset` memory-maps its shards, so a
batch reads only its own rows). Which samples form a batch, and in what order, is
`train.schedule`'s. Right padding plus causal attention means real tokens never
see padding, so no attention mask is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from eagle3_dagster.train.schedule import is_heldout_sample


class HiddenSamples(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    def lengths(self) -> list[int]: ...


class SampleSubset(torch.utils.data.Subset):
    """torch's `Subset` plus the `lengths()` the sampler needs."""

    def lengths(self) -> list[int]:
        every = cast(HiddenSamples, self.dataset).lengths()
        return [every[i] for i in self.indices]


def split_heldout(
    dataset: HiddenSamples, sample_ids: Sequence[str], fraction: float
) -> tuple[SampleSubset, SampleSubset]:
    """(train, held-out) subsets of `dataset` by `is_heldout_sample`; the held-out part is never trained on."""
    held = [i for i, sid in enumerate(sample_ids) if is_heldout_sample(sid, fraction)]
    held_set = set(held)
    train = [i for i in range(len(sample_ids)) if i not in held_set]
    if not train:
        raise ValueError(f"train.eval_fraction {fraction} holds out all {len(sample_ids)} samples; lower it")
    as_dataset = cast(torch.utils.data.Dataset, dataset)  # torch reads it by __getitem__ and __len__ only
    return SampleSubset(as_dataset, train), SampleSubset(as_dataset, held)


@dataclass
class Batch:
    input_ids_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    aux_hidden_BT3H: torch.Tensor
    last_hidden_BTH: torch.Tensor
    num_tokens: int  # real (unpadded) tokens
    sample_ids: list[str]

    def to(self, device: torch.device) -> "Batch":
        def move(x: torch.Tensor) -> torch.Tensor:
            return x.to(device, non_blocking=True)

        return Batch(
            move(self.input_ids_BT),
            move(self.loss_mask_BT),
            move(self.aux_hidden_BT3H),
            move(self.last_hidden_BTH),
            self.num_tokens,
            self.sample_ids,
        )


def collate(dataset: HiddenSamples, indices: list[int], dtype: torch.dtype = torch.float32) -> Batch:
    samples = [dataset[i] for i in indices]
    for idx, s in zip(indices, samples):
        t = len(s["input_ids"])
        for key in ("loss_mask", "aux_hidden", "last_hidden"):
            if s[key].shape[0] != t:
                raise ValueError(
                    f"sample {s.get('sample_id', idx)}: {key} has {s[key].shape[0]} rows, input_ids has {t}"
                )
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
    return Batch(
        ids,
        mask,
        aux,
        last,
        sum(len(s["input_ids"]) for s in samples),
        [str(s.get("sample_id", i)) for i, s in zip(indices, samples)],
    )
