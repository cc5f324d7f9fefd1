"""What gets drafted: the EAGLE-3 drafter and n-gram prompt lookup.

Each class implements `specdec.Proposer`. The EAGLE-3 proposer keeps the
drafter's KV cache in step with the target: positions whose aux states came
from the target stay cached, positions the drafter filled from its own output
while drafting are cropped before the next extend (that is the rollback after a
rejection). The cache is the drafter's own (`model.DraftKVCache`): K and V of every KV head for a GQA
drafter, the latent and rotated shared key (kv_lora_rank + qk_rope_head_dim values per token) for an MLA one,
as SGLang caches them, so drafting costs what it costs served. Proposers with a known answer, for tests, are in
tests/reference_proposers.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class Eagle3Proposer:
    """EAGLE-3 chain drafting (topk 1) with `eagle3_dagster.drafter.model.Eagle3Drafter`.

    The drafter's input at position t is (token t+1, fc(aux_t)) for positions the target has
    verified; each further draft step feeds the drafted token with the drafter's own previous
    `out_hidden`, one position on.
    """

    def __init__(
        self,
        drafter: Any,
        *,
        name: str = "eagle3",
        aux_layers: Sequence[int] | None = None,
        cache_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.drafter = drafter.eval()
        self.name = name
        self.aux_layers = tuple(aux_layers if aux_layers is not None else drafter.cfg.aux_layers)
        if len(self.aux_layers) != 3:
            raise ValueError(f"proposer {name}: EAGLE-3 needs 3 aux layers, got {self.aux_layers}")
        if cache_factory is None:
            from eagle3_dagster.drafter.model import DraftKVCache

            cache_factory = DraftKVCache
        self._new_cache = cache_factory
        param = next(drafter.parameters())
        self._device, self._dtype = param.device, param.dtype
        self.cache = self._new_cache()

    def reset(self) -> None:
        self.cache = self._new_cache()

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], new_aux_1T3H: torch.Tensor | None, k: int) -> list[int]:
        if new_aux_1T3H is None:
            raise ValueError(f"proposer {self.name}: needs the target's aux hidden states, got none")
        n, num_new = len(tokens), new_aux_1T3H.shape[1]
        start = n - 1 - num_new  # first position whose aux state is new
        self.cache.crop(start)
        if len(self.cache) != start:
            raise RuntimeError(
                f"proposer {self.name}: drafter cache holds {len(self.cache)} positions, expected {start}; "
                "aux states were skipped for some verified positions"
            )
        ids = torch.tensor([list(tokens[start + 1 : n])], dtype=torch.long, device=self._device)
        pos = torch.arange(start, n - 1, device=self._device)[None]
        hidden = self.drafter.project_aux(new_aux_1T3H.to(self._device, self._dtype))
        out_hidden, logits = self.drafter.step(ids, hidden, pos, self.cache)
        drafts: list[int] = []
        for j in range(k):
            draft_id = logits[:, -1].argmax(-1)
            target_id = self.drafter.draft_to_target(draft_id)
            drafts.append(int(target_id.item()))
            if j + 1 == k:
                break
            out_hidden, logits = self.drafter.step(
                target_id.view(1, 1),
                out_hidden[:, -1:],
                torch.full((1, 1), n - 1 + j, device=self._device),
                self.cache,
            )
        return drafts


class NgramProposer:
    """Prompt lookup: continue the most recent earlier occurrence of the longest matching suffix.

    The baseline users reach for first (transformers `prompt_lookup_num_tokens`, vLLM/SGLang
    `ngram`); it needs no training and no aux states.
    """

    aux_layers: tuple[int, ...] = ()

    def __init__(self, *, name: str = "ngram", max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.name, self.max_ngram, self.min_ngram = name, max_ngram, min_ngram

    def reset(self) -> None:
        pass

    def propose(self, tokens: Sequence[int], new_aux_1T3H: torch.Tensor | None, k: int) -> list[int]:
        seq = list(tokens)
        n = len(seq)
        for size in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            suffix = seq[n - size :]
            # Latest match first: recent context predicts the continuation best.
            for begin in range(n - size - 1, -1, -1):
                if seq[begin : begin + size] == suffix:
                    follow = seq[begin + size : begin + size + k]
                    if follow:
                        return follow
        return []
