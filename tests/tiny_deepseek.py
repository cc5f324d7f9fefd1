"""The tests' tiny DeepSeek-V3 target (MLA attention, routed and shared experts), declared once: the decoding
tests' target (tests/unit/test_specdec.py, test_mla_specdec.py) and the training workspace's
(tests/unit/test_train.py) are this config. transformers is imported on use, so that importing this costs
collection nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

VOCAB, HIDDEN, LAYERS = 96, 32, 4
TINY_DEEPSEEK_V3: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=LAYERS,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    max_position_embeddings=256,
)


def tiny_deepseek_v3_config(**overrides: Any) -> DeepseekV3Config:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**(TINY_DEEPSEEK_V3 | overrides))


def decoding_target() -> DeepseekV3ForCausalLM:
    """The speculative-decoding tests' target: random weights (seed 0), eval mode, eos 2 (pad 0, bos 1)."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(tiny_deepseek_v3_config(pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
