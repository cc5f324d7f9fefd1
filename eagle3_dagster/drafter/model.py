"""The EAGLE-3 drafter: one decoder layer fed by the target's aux hidden states.

Owns the architecture and its parameter names, which are the names SGLang's
`LlamaForCausalLMEagle3` loads (`fc`, `midlayer.*`, `norm`, `lm_head`, buffers
`d2t`/`t2d`), so the export is a plain state-dict dump. It also owns
inference-time stepping with a KV cache (`step`, `DraftKVCache`), which the
benchmark's speculative-decoding simulator drives. Training-time-test unrolling
lives in `ttt.py`, the loss in `loss.py`, the file format in `export.py`. The layer's attention is
Llama's grouped-query attention (`Attention`, `cfg.attention == "gqa"`) or DeepSeek's multi-latent
attention (`mla.MLAAttention`, "mla"); both take the 2H input and offer the same methods, so
everything around them (TTT, the KV cache, the proposer) is one code path.

Semantics follow SGLang/EAGLE: the drafter input at position t is
(token_{t+1}, fc(aux_t)) during prefill/extend; on later draft steps the hidden
input is the drafter's own pre-`norm` output of the previous step (the normed output with EAGLE 3.1's
`norm_output`, whose `fc_norm` also normalises each captured state before `fc`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_dagster.drafter.blocks import RMSNorm, apply_rotary, repeat_kv, rope_cos_sin
from eagle3_dagster.drafter.mla import MLA_DIMS, MLAAttention, check_rope_scaling, mla_dims

__all__ = [
    "DraftKVCache",
    "DrafterConfig",
    "Eagle3Drafter",
    "MidLayer",
    "RMSNorm",
    "apply_rotary",
    "repeat_kv",
    "rope_cos_sin",
]


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter architecture (the config.json fields SGLang reads from the export: LlamaConfig's for GQA,
    DeepseekV3Config's for MLA)."""

    target_hidden_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    aux_layers: tuple[int, ...] = field(default=())  # canonical numbering (eagle3_dagster/layers.py)
    # EAGLE 3.1, as SGLang (>= 0.5.12) and vLLM read them from config.json: `fc_norm` puts an RMSNorm on
    # each captured state before `fc`; `norm_output` carries the normed output (not the pre-norm sum) to
    # the next draft step.
    fc_norm: bool = False
    norm_output: bool = False
    # "gqa" (the Llama layer) or "mla" (multi-latent attention, `mla.py`): the MLA sizes below are set only for it,
    # with the target's RoPE scaling (DeepSeek yarn) and pair layout; num_key_value_heads and head_dim then
    # describe its expanded heads (num_attention_heads, qk_nope_head_dim + qk_rope_head_dim)
    attention: str = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_scaling: dict | None = None
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"DrafterConfig: attention must be 'gqa' or 'mla', got {self.attention!r}")
        mla = [getattr(self, d) for d in MLA_DIMS]
        if self.attention == "mla":
            if not all(isinstance(v, int) and v > 0 for v in mla):
                raise ValueError(f"DrafterConfig: MLA needs positive {', '.join(MLA_DIMS)}, got {mla}")
            assert self.qk_rope_head_dim is not None  # one of the sizes just checked
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"DrafterConfig: qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        elif any(v is not None for v in mla) or self.rope_scaling is not None:
            raise ValueError("DrafterConfig: MLA sizes and rope_scaling are for attention 'mla' only")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 and self.attention == "gqa":
            raise ValueError(f"DrafterConfig: head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"DrafterConfig: draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}")
        object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))

    @classmethod
    def for_target(
        cls,
        *,
        target_hidden_size: int,
        target_intermediate_size: int,
        vocab_size: int,
        draft_vocab_size: int,
        aux_layers: tuple[int, ...] | list[int],
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 2048,
        fc_norm: bool = False,
        norm_output: bool = False,
        hidden_size: int | None = None,
        intermediate_size: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
    ) -> "DrafterConfig":
        """Defaults as public DeepSeek-V3 drafters: drafter H = target H, head_dim 128, 8 KV heads."""
        h = hidden_size or target_hidden_size
        heads = num_attention_heads or max(1, h // 128)
        if h % heads:
            raise ValueError(f"drafter.hidden_size {h} is not divisible by num_attention_heads {heads}")
        kv = num_key_value_heads or math.gcd(heads, 8)
        return cls(
            target_hidden_size=target_hidden_size,
            hidden_size=h,
            intermediate_size=intermediate_size or target_intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=h // heads,
            vocab_size=vocab_size,
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta,
            max_position_embeddings=max_position_embeddings,
            aux_layers=tuple(aux_layers),
            fc_norm=fc_norm,
            norm_output=norm_output,
        )

    @classmethod
    def from_profile(
        cls, drafter, target, *, draft_vocab_size: int, aux_layers, serving_context: int
    ) -> "DrafterConfig":
        """The drafter for the profile's `drafter` section (`config.DrafterOverrides`) and the target's config
        (`target_head.TargetArch`): what the training worker builds. An MLA drafter takes its sizes, RoPE base
        and scaling from the target unless the profile sets them (`mla.mla_dims` refuses a target without MLA)."""
        common = dict(
            target_hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            aux_layers=tuple(aux_layers),
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=serving_context,
            fc_norm=drafter.fc_norm,
            norm_output=drafter.norm_output,
        )
        if getattr(drafter, "attention", "gqa") != "mla":
            return cls.for_target(
                target_intermediate_size=target.intermediate_size,
                hidden_size=drafter.hidden_size,
                intermediate_size=drafter.intermediate_size,
                num_attention_heads=drafter.num_attention_heads,
                num_key_value_heads=drafter.num_key_value_heads,
                **common,
            )
        dims = mla_dims(drafter, target)
        check_rope_scaling(target.rope_scaling)
        heads = dims["num_attention_heads"]
        return cls(
            hidden_size=drafter.hidden_size or target.hidden_size,
            intermediate_size=drafter.intermediate_size or target.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"],
            attention="mla",
            q_lora_rank=dims["q_lora_rank"],
            kv_lora_rank=dims["kv_lora_rank"],
            qk_nope_head_dim=dims["qk_nope_head_dim"],
            qk_rope_head_dim=dims["qk_rope_head_dim"],
            v_head_dim=dims["v_head_dim"],
            rope_scaling=target.rope_scaling,
            rope_interleave=target.rope_interleave,
            **common,
        )

    def kv_values_per_token(self) -> int:
        """Values the draft KV cache holds per token: K and V of every KV head (GQA), or the MLA latent and the
        shared rotary key (kv_lora_rank + qk_rope_head_dim)."""
        if self.attention == "mla":
            assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None  # __post_init__: set for mla
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_key_value_heads * self.head_dim


class Attention(nn.Module):
    """Llama's grouped-query attention over the 2H input.

    The interface `MidLayer` and `ttt.py` use (shared with `mla.MLAAttention`): `in_proj_weight` (every
    projection of the 2H input, stacked), `rope_tables`, `split` (the projected input at some positions →
    queries and the cache entry of those positions) and `keys_values` (cache entries → keys and values with the
    query's head count); `project` is the input projection at inference."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h2, hd = 2 * cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(h2, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(h2, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(h2, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)

    def in_proj_weight(self) -> torch.Tensor:
        return torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])

    def project(self, x_BT2H: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_proj(x_BT2H), self.k_proj(x_BT2H), self.v_proj(x_BT2H)], dim=-1)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)

    def split(self, proj_BTX: torch.Tensor, cos_B1TD: torch.Tensor, sin_B1TD: torch.Tensor):
        """(q [B,Nq,T,D], the cache entry (k, v) [B,Nkv,T,D]), RoPE applied."""
        c = self.cfg
        b, t, _ = proj_BTX.shape
        widths = [c.num_attention_heads * c.head_dim, *[c.num_key_value_heads * c.head_dim] * 2]
        q, k, v = (x.view(b, t, -1, c.head_dim).transpose(1, 2) for x in proj_BTX.split(widths, dim=-1))
        return apply_rotary(q, cos_B1TD, sin_B1TD), (apply_rotary(k, cos_B1TD, sin_B1TD), v)

    def keys_values(self, entry: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = entry
        return repeat_kv(k, self.cfg.num_attention_heads), repeat_kv(v, self.cfg.num_attention_heads)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The decoder layer, split around attention so training and inference share everything else."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.self_attn = MLAAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def queries(self, embeds_BTH, hidden_BTH, position_ids_BT):
        """(q [B,N,T,D], the cache entry of these positions), RoPE applied at `position_ids`."""
        x = torch.cat([self.input_layernorm(embeds_BTH), self.hidden_norm(hidden_BTH)], dim=-1)
        cos, sin = self.self_attn.rope_tables(position_ids_BT[:, None, :])
        return self.self_attn.split(self.self_attn.project(x), cos, sin)

    def qkv(self, embeds_BTH, hidden_BTH, position_ids_BT):
        """q [B,Nq,T,D] and k, v: GQA's [B,Nkv,T,D] before repetition; MLA's expanded to every head."""
        q, entry = self.queries(embeds_BTH, hidden_BTH, position_ids_BT)
        return (q, *entry) if self.cfg.attention == "gqa" else (q, *self.self_attn.keys_values(entry))

    def finish(self, attn_BNTD: torch.Tensor, residual_BTH: torch.Tensor) -> torch.Tensor:
        """o_proj + residual from the (un-normed) hidden stream, then the MLP block; returns pre-`norm` output."""
        return self.mlp_block(self.attn_residual(attn_BNTD, residual_BTH))

    def attn_residual(self, attn_BNTD: torch.Tensor, residual_BTH: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn_BNTD.shape
        return residual_BTH + self.self_attn.o_proj(attn_BNTD.transpose(1, 2).reshape(b, t, -1))

    def mlp_block(self, h_BTH: torch.Tensor) -> torch.Tensor:
        """The post-attention half (norm, MLP, residual); training recomputes it in backward on long sequences."""
        return h_BTH + self.mlp(self.post_attention_layernorm(h_BTH))


class DraftKVCache:
    """Growable cache of the one drafter layer; `crop` rolls back rejected draft tokens.

    It holds what the attention's `split` returns per position, each [B, heads, T, D]: GQA's K and V of every
    KV head, MLA's latent and rotated shared key part (kv_lora_rank + qk_rope_head_dim values per token)."""

    def __init__(self) -> None:
        self.parts: tuple[torch.Tensor, ...] = ()

    def __len__(self) -> int:
        return self.parts[0].shape[2] if self.parts else 0

    def values_per_token(self) -> int:
        return sum(p.shape[1] * p.shape[3] for p in self.parts)

    def append(self, *parts_BNTD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.parts = (
            parts_BNTD
            if not self.parts
            else tuple(torch.cat([old, new], dim=2) for old, new in zip(self.parts, parts_BNTD, strict=True))
        )
        return self.parts

    def crop(self, length: int) -> None:
        if length < 0 or length > len(self):
            raise ValueError(f"DraftKVCache.crop: length {length} outside [0, {len(self)}]")
        self.parts = tuple(p[:, :, :length] for p in self.parts)


class Eagle3Drafter(nn.Module):
    d2t: torch.Tensor  # buffers, registered in __init__
    t2d: torch.Tensor

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        super().__init__()
        if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"target embedding has shape {tuple(embed_weight.shape)}, drafter expects "
                f"({cfg.vocab_size}, {cfg.hidden_size}) (vocab_size, hidden_size)"
            )
        if tuple(d2t.shape) != (cfg.draft_vocab_size,) or tuple(t2d.shape) != (cfg.vocab_size,):
            raise ValueError(
                f"vocab mapping shapes d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match "
                f"draft_vocab_size {cfg.draft_vocab_size} / vocab_size {cfg.vocab_size}"
            )
        hot_ids = torch.arange(cfg.draft_vocab_size) + d2t.to(torch.int64)
        if not torch.equal(t2d.to(torch.bool).nonzero().squeeze(-1), hot_ids):
            # the teacher indexes target logits by t2d, SGLang maps draft ids by d2t: they must name the same ids
            raise ValueError("vocab mapping: t2d's True ids are not arange(draft_vocab) + d2t in ascending order")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.data.copy_(embed_weight)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen; never exported
        # SGLang's names: `fc_norm.{i}` (one per captured state, low to high), before `fc`
        self.fc_norm = (
            nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3)])
            if cfg.fc_norm
            else None
        )
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", d2t.to(torch.int64).clone())
        self.register_buffer("t2d", t2d.to(torch.bool).clone())

    def project_aux(self, aux_hidden_BT3H: torch.Tensor) -> torch.Tensor:
        if self.fc_norm is not None:
            chunks = aux_hidden_BT3H.chunk(3, dim=-1)
            aux_hidden_BT3H = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux_hidden_BT3H)

    def logits(self, out_hidden_BTH: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out_hidden_BTH))

    def carried(self, out_hidden_BTH: torch.Tensor, normed_BTH: torch.Tensor) -> torch.Tensor:
        """The hidden input of the next draft step: the pre-`norm` output, or with `norm_output` the normed one."""
        return normed_BTH if self.cfg.norm_output else out_hidden_BTH

    def step(
        self,
        input_ids_BT: torch.Tensor,
        hidden_BTH: torch.Tensor,
        position_ids_BT: torch.Tensor,
        cache: DraftKVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder pass, causal over the cached keys plus the new tokens; returns (the hidden input of the
        next step, draft_logits)."""
        embeds = self.embed_tokens(input_ids_BT).to(hidden_BTH.dtype)
        q, entry = self.midlayer.queries(embeds, hidden_BTH, position_ids_BT)
        past = 0
        if cache is not None:
            past = len(cache)
            entry = cache.append(*entry)
        k, v = self.midlayer.self_attn.keys_values(entry)
        t = q.shape[2]
        if past == 0:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # query i (absolute past+i) sees keys 0..past+i; small at inference (t is a handful of tokens)
            mask = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(diagonal=past)
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out_hidden = self.midlayer.finish(attn, hidden_BTH)
        normed = self.norm(out_hidden)
        return self.carried(out_hidden, normed), self.lm_head(normed)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything SGLang loads: all parameters and buffers except the frozen target embedding."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}
