"""The EAGLE-3 drafter: one Llama decoder layer fed by the target's aux hidden states.

Owns the architecture and its parameter names, which are the names SGLang's
`LlamaForCausalLMEagle3` loads (`fc`, `midlayer.*`, `norm`, `lm_head`, buffers
`d2t`/`t2d`), so the export is a plain state-dict dump. It also owns
inference-time stepping with a KV cache (`step`, `DraftKVCache`), which the
benchmark's speculative-decoding simulator drives. Training-time-test unrolling
lives in `ttt.py`, the loss in `loss.py`, the file format in `export.py`.

Semantics follow SGLang/EAGLE: the drafter input at position t is
(token_{t+1}, fc(aux_t)) during prefill/extend; on later draft steps the hidden
input is the drafter's own pre-`norm` output of the previous step (the normed output with EAGLE 3.1's
`norm_output`, whose `fc_norm` also normalises each captured state before `fc`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DrafterConfig:
    """The drafter architecture (the LlamaConfig fields SGLang reads from the export)."""

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

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DrafterConfig: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
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


class RMSNorm(nn.Module):
    """Llama's RMSNorm (normalise in fp32, cast back, then scale), bit-compatible with SGLang's."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama default RoPE angles (rotate-half layout) at `position_ids`: cos, sin of shape [*position_ids.shape, D], fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x_BNTD: torch.Tensor, cos_B1TD: torch.Tensor, sin_B1TD: torch.Tensor) -> torch.Tensor:
    d = x_BNTD.shape[-1]
    cos, sin = cos_B1TD.to(x_BNTD.dtype), sin_B1TD.to(x_BNTD.dtype)
    x1, x2 = x_BNTD[..., : d // 2], x_BNTD[..., d // 2 :]
    return x_BNTD * cos + torch.cat([-x2, x1], dim=-1) * sin


def rotary(x_BNTD: torch.Tensor, position_ids_BT: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama default RoPE (rotate-half layout), computed from positions on the fly."""
    cos, sin = rope_cos_sin(position_ids_BT[:, None, :], x_BNTD.shape[-1], theta)
    return apply_rotary(x_BNTD, cos, sin)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h2, hd = 2 * cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h2, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(h2, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(h2, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)


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
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def qkv(self, embeds_BTH, hidden_BTH, position_ids_BT):
        """Return q [B,Nq,T,D] and k, v [B,Nkv,T,D], RoPE applied at `position_ids`."""
        b, t, _ = hidden_BTH.shape
        x = torch.cat([self.input_layernorm(embeds_BTH), self.hidden_norm(hidden_BTH)], dim=-1)
        a, c = self.self_attn, self.cfg
        q = a.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return rotary(q, position_ids_BT, c.rope_theta), rotary(k, position_ids_BT, c.rope_theta), v

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
    """Growable K/V cache of the one drafter layer; `crop` rolls back rejected draft tokens."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k_BNTD: torch.Tensor, v_BNTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k_BNTD if self.k is None else torch.cat([self.k, k_BNTD], dim=2)
        self.v = v_BNTD if self.v is None else torch.cat([self.v, v_BNTD], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if length < 0 or length > len(self):
            raise ValueError(f"DraftKVCache.crop: length {length} outside [0, {len(self)}]")
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


def repeat_kv(x_BNTD: torch.Tensor, num_heads: int) -> torch.Tensor:
    rep = num_heads // x_BNTD.shape[1]
    return x_BNTD if rep == 1 else x_BNTD.repeat_interleave(rep, dim=1)


class Eagle3Drafter(nn.Module):
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
        self.fc_norm = nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3)]) \
            if cfg.fc_norm else None
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
        q, k, v = self.midlayer.qkv(embeds, hidden_BTH, position_ids_BT)
        past = 0
        if cache is not None:
            past = len(cache)
            k, v = cache.append(k, v)
        nq, t = self.cfg.num_attention_heads, q.shape[2]
        k, v = repeat_kv(k, nq), repeat_kv(v, nq)
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
