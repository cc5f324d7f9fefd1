"""The tiny target's architecture: a `transformers` DeepSeek-V3 model shaped like Kimi-K2.5's text model.

Owns: mapping `TinyTargetConfig` onto a `DeepseekV3Config` that keeps every
structural feature of the real target - MLA with a q LoRA, MoE with a shared
expert and sigmoid/noaux_tc routing, the first layer dense, untied lm_head, no
MTP layer - at sizes a CPU can pre-train in minutes.

Hidden-state convention, verified in transformers 5.24
`modeling_deepseek_v3.py` (and pinned by tests/unit/test_tiny_target.py):
`output_hidden_states=True` returns L+1 states; index 0 is the embedding output,
index i the output of layer i-1 (= the state entering layer i, un-normalised),
and index L is the final hidden *after* `model.norm`, so
`lm_head(hidden_states[L])` are the logits. This is the canonical numbering of
`eagle3_dagster.layers`.
"""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from eagle3_dagster.config import TinyTargetConfig

# Kimi-K2.5's config.json values where they do not depend on size.
ROPE_THETA = 50_000.0
ROUTED_SCALING_FACTOR = 2.827
RMS_NORM_EPS = 1e-5


def tiny_model_config(
    cfg: TinyTargetConfig, *, vocab_size: int, bos_token_id: int, eos_token_id: int | list[int], pad_token_id: int
) -> DeepseekV3Config:
    """Kimi-K2.5's text_config with the sizes of `cfg`.

    n_group = topk_group = 1 as in Kimi (one group: every expert is eligible), so
    top-k routing really picks `num_experts_per_tok` of `n_routed_experts` per token.
    """
    if cfg.n_routed_experts < max(2, cfg.num_experts_per_tok):
        raise ValueError(
            f"target.tiny.n_routed_experts ({cfg.n_routed_experts}) must be >= 2 and >= num_experts_per_tok "
            f"({cfg.num_experts_per_tok}) for top-k routing"
        )
    if cfg.first_k_dense_replace >= cfg.num_hidden_layers:
        raise ValueError("target.tiny.first_k_dense_replace must leave at least one MoE layer")
    # moe_layer_freq, topk_method and scoring_func are not DeepseekV3Config's parameters in transformers 5; passed
    # on, they stay attributes of the config and in config.json, where SGLang's DeepseekV2 reads them
    return DeepseekV3Config(  # type: ignore[call-arg]
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        v_head_dim=cfg.v_head_dim,
        n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_shared_experts=cfg.n_shared_experts,
        first_k_dense_replace=cfg.first_k_dense_replace,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=ROUTED_SCALING_FACTOR,
        # SGLang reads these three directly (Kimi-K2.5's config.json has them); transformers 5's
        # DeepseekV3Config does not write them, and its routing is this one (sigmoid, noaux_tc) anyway.
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        num_mtp_layers=0,  # Kimi ships no MTP head (num_nextn_predict_layers = 0)
        max_position_embeddings=cfg.max_position_embeddings,
        # DeepSeek yarn at factor 1.0 is the plain RoPE (transformers' logits are bit-identical to
        # rope_type "default"), and it is the only RoPE SGLang's CPU path builds for DeepSeek.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": ROPE_THETA,
            "factor": 1.0,
            "original_max_position_embeddings": cfg.max_position_embeddings,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rope_interleave=True,
        rms_norm_eps=RMS_NORM_EPS,
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        initializer_range=0.02,
        use_cache=True,
    )


def create_tiny_model(config: DeepseekV3Config, seed: int) -> DeepseekV3ForCausalLM:
    """Randomly initialised, identically for the same config and seed."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config)
    return model.float()


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
