"""Aux-layer numbering: the one place the three conventions meet.

Canonical (this project, every shard and export records it): the state captured
*before* layer i runs = HF `output_hidden_states[i]`; index 0 is the embeddings,
index L is the final hidden after the final norm.

SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` is in *output*
numbering: SGLang captures before layer `id + 1`, so canonical i = sglang id + 1.
vLLM reads a top-level `eagle_aux_hidden_state_layer_ids` in input (canonical)
numbering. An off-by-one here silently costs acceptance at serve time.
"""

from __future__ import annotations

CANONICAL_NUMBERING = "hf_output_hidden_states_index"


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's default [2, L//2, L-3] in canonical numbering ([2, 30, 58] for 61 layers)."""
    return [2, num_layers // 2, num_layers - 3]


def validate_aux_layers(layers: list[int], num_layers: int) -> list[int]:
    if len(layers) != 3:
        raise ValueError(f"hidden.aux_layers: EAGLE-3 uses exactly 3 aux layers, got {layers}")
    if sorted(set(layers)) != list(layers):
        raise ValueError(f"hidden.aux_layers: must be strictly increasing, got {layers}")
    if layers[0] < 1 or layers[-1] > num_layers - 1:
        raise ValueError(
            f"hidden.aux_layers: canonical ids must lie in [1, {num_layers - 1}] for a {num_layers}-layer target, "
            f"got {layers}"
        )
    return list(layers)


def sglang_to_canonical(layers: list[int]) -> list[int]:
    return [i + 1 for i in layers]


def canonical_to_vllm(layers: list[int]) -> list[int]:
    return list(layers)
