"""Proposers with a known answer, for testing the speculative-decoding core (not used by the benchmark).

`OracleProposer` drafts the target's greedy continuation (every draft accepted);
`AlwaysWrongProposer` drafts a token the target never picks (acceptance length 1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


class _ReferenceProposer:
    """Knows each prompt's greedy continuation; subclasses decide what to draft from it."""

    aux_layers: tuple[int, ...] = ()

    def __init__(self, continuations: Mapping[tuple[int, ...], Sequence[int]], name: str) -> None:
        self.continuations = {tuple(p): list(c) for p, c in continuations.items()}
        self.name = name

    def reset(self) -> None:
        pass

    def _reference(self, tokens: Sequence[int]) -> tuple[list[int], int]:
        for prompt, cont in self.continuations.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                return cont, len(tokens) - len(prompt)
        raise KeyError(f"proposer {self.name}: no reference continuation for a prompt of {len(tokens)} tokens")


class OracleProposer(_ReferenceProposer):
    """Drafts exactly the target's greedy continuation: every draft must be accepted."""

    def __init__(self, continuations: Mapping[tuple[int, ...], Sequence[int]], name: str = "oracle") -> None:
        super().__init__(continuations, name)

    def propose(self, tokens: Sequence[int], new_aux_1T3H: torch.Tensor | None, k: int) -> list[int]:
        cont, done = self._reference(tokens)
        return cont[done : done + k]


class AlwaysWrongProposer(_ReferenceProposer):
    """Drafts a token the target will not pick at every position: acceptance length must be 1."""

    def __init__(
        self, continuations: Mapping[tuple[int, ...], Sequence[int]], vocab_size: int, name: str = "always_wrong"
    ) -> None:
        super().__init__(continuations, name)
        self.vocab_size = vocab_size

    def propose(self, tokens: Sequence[int], new_aux_1T3H: torch.Tensor | None, k: int) -> list[int]:
        cont, done = self._reference(tokens)
        return [(t + 1) % self.vocab_size for t in cont[done : done + k]]
