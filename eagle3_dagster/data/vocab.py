"""vocab_mapping: the drafter's vocabulary, chosen from the tokens the target generated in training data.

Owns: counting target ids where `loss_mask == 1` (streaming over merged_train),
choosing the draft vocabulary and writing `d2t` / `t2d` with safetensors.

Semantics (EAGLE `cnets.py::scandata`, SpecForge `process_token_dict_to_mappings`,
speculators `vocab_mapping.py`): keep the N most frequent ids (ties to the smaller
id; ids never seen fill up with count 0 in id order, as SpecForge/speculators pad),
sort them ascending; `d2t[i] = target_id_of_draft_i - i` (int64), so
`target_id = i + d2t[i]`, which is what SGLang's `LlamaForCausalLMEagle3.load_weights`
computes (`hot_token_id = d2t + arange`) and vLLM's `draft_id_to_target_id`;
`t2d` is a bool mask over the target vocab used by training (engines ignore it).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import orjson
import torch
from safetensors.torch import save

from eagle3_dagster.io import atomic_write_bytes

log = logging.getLogger(__name__)


@dataclass
class VocabStats:
    target_vocab_size: int
    draft_vocab_size: int  # as built (the target's vocab when that is smaller than requested)
    requested_draft_vocab_size: int
    draft_vocab_covers_target: bool  # the target vocab was not larger than the requested size
    num_loss_tokens: int
    num_distinct_loss_tokens: int
    loss_token_coverage: float  # share of loss tokens whose id is in the draft vocab
    # share of loss tokens the top-n ids cover, n = 1,024, 2,048, ... up to the target vocab: the curve a
    # user reads on the real corpus to choose `data.draft_vocab_size` (lm_head cost grows with n)
    coverage_by_size: dict[str, float]

    def as_dict(self) -> dict:
        return asdict(self)


def count_loss_tokens(paths: Iterable[str | os.PathLike], target_vocab_size: int) -> np.ndarray:
    """Counts of each target id at positions with loss_mask == 1, one record at a time."""
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    for path in paths:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = orjson.loads(line)
                ids = np.asarray(record["input_ids"], dtype=np.int64)
                mask = np.asarray(record["loss_mask"], dtype=bool)
                if ids.shape != mask.shape:
                    raise ValueError(f"{path}:{lineno}: loss_mask length {mask.size} != input_ids length {ids.size}")
                chosen = ids[mask]
                if chosen.size and (chosen.min() < 0 or chosen.max() >= target_vocab_size):
                    raise ValueError(f"{path}:{lineno}: token id outside the target vocab [0, {target_vocab_size})")
                counts += np.bincount(chosen, minlength=target_vocab_size)
    return counts


def select_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """The draft vocabulary as ascending target ids: top `draft_vocab_size` by count, ties to the smaller id."""
    n = min(draft_vocab_size, counts.size)
    ranked = np.lexsort((np.arange(counts.size), -counts))  # primary key: -count, then id
    return np.sort(ranked[:n])


def coverage_curve(counts: np.ndarray) -> dict[str, float]:
    """{n: share of the counted tokens the n most frequent ids cover}, n doubling from 1,024 to the vocab."""
    total = int(counts.sum())
    cumulative = np.cumsum(np.sort(counts)[::-1])
    sizes = [n for n in (2**k for k in range(10, 40)) if n < counts.size] + [counts.size]
    return {str(n): round(float(cumulative[n - 1] / total), 6) if total else 0.0 for n in sizes}


def build_mapping(draft_ids: np.ndarray, target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 offsets, t2d bool mask) for ascending draft ids."""
    d2t = torch.from_numpy(draft_ids.astype(np.int64) - np.arange(len(draft_ids), dtype=np.int64))
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(draft_ids.astype(np.int64))] = True
    return d2t, t2d


def build_vocab_mapping(
    paths: Iterable[str | os.PathLike], out_path: str | os.PathLike, *, target_vocab_size: int, draft_vocab_size: int
) -> VocabStats:
    """Count, choose and save `{"d2t", "t2d"}` (safetensors) at `out_path`."""
    counts = count_loss_tokens(paths, target_vocab_size)
    covers = target_vocab_size <= draft_vocab_size
    if covers:
        log.warning(
            "target vocab (%d) is not larger than the requested draft vocab (%d): the draft vocab is "
            "the whole target vocab",
            target_vocab_size,
            draft_vocab_size,
        )
    draft_ids = select_draft_vocab(counts, draft_vocab_size)
    d2t, t2d = build_mapping(draft_ids, target_vocab_size)
    total = int(counts.sum())
    stats = VocabStats(
        target_vocab_size=target_vocab_size,
        draft_vocab_size=len(draft_ids),
        requested_draft_vocab_size=draft_vocab_size,
        draft_vocab_covers_target=covers,
        num_loss_tokens=total,
        num_distinct_loss_tokens=int((counts > 0).sum()),
        loss_token_coverage=float(counts[draft_ids].sum() / total) if total else 0.0,
        coverage_by_size=coverage_curve(counts),
    )
    metadata = {k: str(v) for k, v in stats.as_dict().items()}
    atomic_write_bytes(Path(out_path), save({"d2t": d2t, "t2d": t2d}, metadata=metadata))
    log.info(
        "draft vocab %d of %d ids covers %.2f%% of loss tokens",
        stats.draft_vocab_size,
        target_vocab_size,
        100 * stats.loss_token_coverage,
    )
    return stats
