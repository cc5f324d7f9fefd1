"""The drafter's multi-latent attention (`drafter.attention: mla`), as SGLang's `Eagle3DeepseekV2ForCausalLM` runs it.

Owns the MLA attention module, its parameter names (those of SGLang 0.5.23
`sglang/srt/models/kimi_k25_eagle3.py` and of DeepSeek-V3: `q_a_proj`,
`q_a_layernorm`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`,
`o_proj`), DeepSeek's RoPE on the rotary part (yarn from the target's
`rope_scaling`, rotary pairs interleaved), and where the MLA sizes come from (the
target's config.json, each overridable in the profile). The decoder layer around it
and everything else is the GQA drafter's (`model.py`).

What SGLang's `Eagle3MLADecoderLayer` computes on the 2H input
x = cat(input_layernorm(embeds), hidden_norm(hidden)):
  q      = q_b_proj(q_a_layernorm(q_a_proj(x)))                 per head [nope | rope]
  c, k_r = kv_a_proj_with_mqa(x) split [kv_lora_rank | rope]    one latent shared by every head
  k, v   = kv_b_proj(kv_a_layernorm(c))                         per head [nope | v]
  scores = (q_nope·k_nope + rope(q_rope)·rope(k_r)) · qk_head_dim^-0.5 · mscale²
The KV cache holds (kv_a_layernorm(c), rope(k_r)) per token: kv_lora_rank + qk_rope_head_dim values; SGLang
absorbs kv_b_proj into the query instead of expanding the latent, which is the same product. The softmax scale's
yarn factor is applied to the queries, so the attention kernels keep their default 1/sqrt(head size).
"""

from __future__ import annotations

import math
import torch
from torch import nn

from eagle3_dagster.drafter.blocks import RMSNorm, apply_rotary

MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
ROPE_KINDS = ("yarn", "deepseek_yarn")  # what SGLang's MLA builds from a draft config (DeepSeek yarn), besides plain


def mla_dims(overrides, target) -> dict[str, int]:
    """The MLA sizes and head count: the profile's `drafter.*`, else the target's config.json (`TargetArch`).

    A size neither gives (a target without MLA) is a ValueError naming the profile field to set."""
    dims = {}
    for name in ("num_attention_heads", *MLA_DIMS):
        value = getattr(overrides, name, None) or getattr(target, name, None)
        if not value:
            raise ValueError(
                f"drafter.{name}: the target's config.json has no {name} (it has no multi-latent "
                f"attention), so drafter.attention: mla needs drafter.{name} set; or use "
                "drafter.attention: gqa"
            )
        dims[name] = int(value)
    return dims


def check_rope_scaling(rope_scaling: dict | None) -> None:
    if rope_scaling is not None and rope_scaling.get("type") not in ROPE_KINDS:
        raise ValueError(
            f"MLA drafter: rope_scaling type {rope_scaling.get('type')!r}; SGLang's MLA draft layer "
            f"builds DeepSeek yarn ({', '.join(ROPE_KINDS)}) or plain RoPE"
        )


def yarn_get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, theta: float, rope_scaling: dict | None, device=None) -> torch.Tensor:
    """SGLang's `DeepseekScalingRotaryEmbedding._compute_inv_freq` (plain RoPE without scaling)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    if rope_scaling is None:
        return 1.0 / pos_freqs
    factor = float(rope_scaling.get("factor", 1.0))
    original = float(rope_scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(float(rope_scaling.get("beta_fast", 32)))), 0)
    high: float = min(math.ceil(correction_dim(float(rope_scaling.get("beta_slow", 1)))), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    mask = (1 - ramp) * float(rope_scaling.get("extrapolation_factor", 1))
    return (1.0 / (factor * pos_freqs)) * (1 - mask) + (1.0 / pos_freqs) * mask


def rope_mscale(rope_scaling: dict | None) -> tuple[float, float]:
    """(factor on cos/sin, factor on the softmax scale), as SGLang's yarn rotary and `compute_mla_mscale_scaling`."""
    if rope_scaling is None:
        return 1.0, 1.0
    factor = float(rope_scaling.get("factor", 1.0))
    all_dim = float(rope_scaling.get("mscale_all_dim") or 0)
    cos_sin = (
        yarn_get_mscale(factor, float(rope_scaling.get("mscale", 1)))
        / yarn_get_mscale(factor, all_dim)
        * float(rope_scaling.get("attn_factor", 1))
    )
    softmax = yarn_get_mscale(factor, all_dim) ** 2 if rope_scaling.get("apply_yarn_scaling", True) else 1.0
    return cos_sin, softmax


def mla_rope_tables(positions: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, qk_rope_head_dim] (fp32, rotate-half layout) at `positions`."""
    inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, positions.device)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    scale, _ = rope_mscale(cfg.rope_scaling)
    return emb.cos() * scale, emb.sin() * scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE on the rotary part. Interleaved (DeepSeek, SGLang's `is_neox_style=False`) rotates pairs (2i, 2i+1);
    they are gathered first ([evens | odds], as transformers' `apply_rotary_pos_emb_interleave`), which permutes q
    and k alike and so leaves every score as it is."""
    if interleave:
        x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    return apply_rotary(x, cos, sin)


class MLAAttention(nn.Module):
    """Multi-latent attention over the 2H input; the same interface as `model.Attention` (see `MidLayer`)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        check_rope_scaling(cfg.rope_scaling)
        h2, n = 2 * cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        self.q_a_proj = nn.Linear(h2, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, n * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h2, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.q_scale = rope_mscale(cfg.rope_scaling)[1]

    def in_proj_weight(self) -> torch.Tensor:
        """The projections of the 2H input, stacked (SGLang fuses them as `fused_qkv_a_proj_with_mqa`)."""
        return torch.cat([self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight])

    def project(self, x_BT2H: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_a_proj(x_BT2H), self.kv_a_proj_with_mqa(x_BT2H)], dim=-1)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mla_rope_tables(positions, self.cfg)

    def split(self, proj_BTX: torch.Tensor, cos_B1TD: torch.Tensor, sin_B1TD: torch.Tensor):
        """(q [B,N,T,nope+rope], cache entry): the entry is the latent [B,1,T,kv_lora_rank] and the rotated
        shared key part [B,1,T,qk_rope_head_dim]."""
        c = self.cfg
        b, t, _ = proj_BTX.shape
        q_a, latent, k_rope = proj_BTX.split([c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        q = self.q_b_proj(self.q_a_layernorm(q_a)).view(b, t, c.num_attention_heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, rotate(q_rope, cos_B1TD, sin_B1TD, c.rope_interleave)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        latent = self.kv_a_layernorm(latent)[:, None]
        k_rope = rotate(k_rope[:, None], cos_B1TD, sin_B1TD, c.rope_interleave)
        return q, (latent, k_rope)

    def keys_values(self, entry: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """k [B,N,S,nope+rope] and v [B,N,S,v_head_dim] of cached positions, expanded from their latents."""
        latent, k_rope = entry
        c = self.cfg
        b, _, s, _ = latent.shape
        kv = self.kv_b_proj(latent[:, 0]).view(b, s, c.num_attention_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        return torch.cat([k_nope, k_rope.expand(-1, c.num_attention_heads, -1, -1)], dim=-1), v
