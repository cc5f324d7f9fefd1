"""The MLA drafter's file layout: what SGLang's `Eagle3DeepseekV2ForCausalLM` and vLLM's load.

Owns the config.json fields and weight names of an MLA drafter export, and what is
wrong with a config.json claiming that layout. `export.py` writes and checks exports
of both attentions and dispatches here on `architectures`; `imported.py` reads
another trainer's MLA drafter through the same names.

Read from SGLang 0.5.23 `sglang/srt/models/kimi_k25_eagle3.py` (the class exists from 0.5.12;
`sglang_releases` records which release has it): config.json is a DeepSeek-V3 config
(transformers' `DeepseekV3Config`; SGLang's `ModelConfig` sets up the MLA KV cache from
`kv_lora_rank` / `qk_rope_head_dim` for this architecture) with `num_hidden_layers` 1, and
`q_lora_rank` is required ("Eagle3 MLA layer requires q_lora_rank"). `load_weights` maps
`layers.0.X` to `model.midlayer.X` (a `midlayer.X` name is taken as is), prefixes `model.`
to everything but `lm_head`, stacks gate/up into `gate_up_proj`, fuses `q_a_proj` and
`kv_a_proj_with_mqa` into `fused_qkv_a_proj_with_mqa`, turns `d2t` into hot token ids, skips
`t2d`, and skips any other unknown name with a warning only: a missing weight is never
reported, hence the key-by-key check. The rotary part uses the config's `rope_scaling`
(DeepSeek yarn; SGLang's CPU path builds no other) with pairs interleaved unless
`rope_interleave` is false. vLLM's `vllm/model_executor/models/deepseek_eagle3.py` loads the
same names (`midlayer.` → `layers.0.`; `d2t` → `draft_id_to_target_id`; `t2d` skipped).
"""

from __future__ import annotations

from eagle3_dagster.drafter.mla import MLA_DIMS, ROPE_KINDS

ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MODEL_TYPE = "deepseek_v3"  # transformers' own DeepseekV3Config: SGLang and vLLM read it without remote code
LAYER = "layers.0."  # the checkpoint's decoder-layer prefix (kimi-k2.5-eagle3-mla's); our module is `midlayer.`

# name → (rows, cols) as products of the sizes `dims` derives from config.json
WEIGHTS: dict[str, tuple[str, ...]] = {
    "fc.weight": ("hidden_size", "3*target_hidden_size"),
    LAYER + "self_attn.q_a_proj.weight": ("q_lora_rank", "2*hidden_size"),
    LAYER + "self_attn.q_a_layernorm.weight": ("q_lora_rank",),
    LAYER + "self_attn.q_b_proj.weight": ("num_attention_heads*qk_head_dim", "q_lora_rank"),
    LAYER + "self_attn.kv_a_proj_with_mqa.weight": ("kv_a_width", "2*hidden_size"),
    LAYER + "self_attn.kv_a_layernorm.weight": ("kv_lora_rank",),
    LAYER + "self_attn.kv_b_proj.weight": ("num_attention_heads*kv_b_width", "kv_lora_rank"),
    LAYER + "self_attn.o_proj.weight": ("hidden_size", "num_attention_heads*v_head_dim"),
    LAYER + "mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
    LAYER + "mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
    LAYER + "mlp.down_proj.weight": ("hidden_size", "intermediate_size"),
    LAYER + "input_layernorm.weight": ("hidden_size",),
    LAYER + "hidden_norm.weight": ("hidden_size",),
    LAYER + "post_attention_layernorm.weight": ("hidden_size",),
    "norm.weight": ("hidden_size",),
    "lm_head.weight": ("draft_vocab_size", "hidden_size"),
    "d2t": ("draft_vocab_size",),
    "t2d": ("vocab_size",),
}


def is_mla(config: dict) -> bool:
    return config.get("architectures") == [ARCHITECTURE]


def dims(config: dict) -> dict[str, int]:
    """The MLA sizes SGLang reads from config.json (besides the common ones `export._sglang_dims` derives)."""
    d = {k: int(config[k]) for k in MLA_DIMS}
    return d | {
        "qk_head_dim": d["qk_nope_head_dim"] + d["qk_rope_head_dim"],
        "kv_a_width": d["kv_lora_rank"] + d["qk_rope_head_dim"],
        "kv_b_width": d["qk_nope_head_dim"] + d["v_head_dim"],
    }


def to_checkpoint(state: dict) -> dict:
    """Our module's names (`midlayer.*`) → the checkpoint's (`layers.0.*`)."""
    return {(LAYER + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in state.items()}


def from_checkpoint(state: dict) -> dict:
    """A checkpoint's names (`layers.0.*`, or `midlayer.*` which SGLang also takes) → our module's."""
    return {("midlayer." + k[len(LAYER) :] if k.startswith(LAYER) else k): v for k, v in state.items()}


def config_fields(cfg) -> dict:
    """The DeepSeek-V3 config.json fields of a `DrafterConfig` with attention 'mla'."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.target_hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        **{k: getattr(cfg, k) for k in MLA_DIMS},
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "rope_interleave": cfg.rope_interleave,
    }


def config_errors(config: dict) -> list[str]:
    """What keeps SGLang from serving config.json as the MLA drafter it claims to be (or this benchmark from
    drafting like it), each naming the field."""
    from eagle3_dagster.drafter.target_head import rope_scaling

    errors = []
    if not config.get("q_lora_rank"):
        errors.append("config.json q_lora_rank is unset: SGLang's Eagle3 MLA layer requires it")
    missing = [k for k in MLA_DIMS if config.get(k) is None]
    if missing:
        errors.append(f"config.json lacks {', '.join(missing)}, which an MLA drafter needs")
    elif int(config["qk_rope_head_dim"]) % 2:
        errors.append(f"config.json qk_rope_head_dim={config['qk_rope_head_dim']}: RoPE needs an even size")
    kind = (rope_scaling(config) or {}).get("type")
    if kind not in (None, *ROPE_KINDS):
        errors.append(f"config.json RoPE type {kind!r}: SGLang's MLA draft layer builds DeepSeek yarn or plain RoPE")
    if config.get("hidden_act", "silu") != "silu":
        errors.append(f"config.json hidden_act={config['hidden_act']!r}; the drafter's MLP is SiLU")
    return errors
