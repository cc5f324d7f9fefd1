"""The drafter's building blocks shared by its two attentions (`model.Attention`, `mla.MLAAttention`): RMSNorm,
RoPE in the rotate-half layout, and the repetition of GQA's key/value heads."""

from __future__ import annotations

import torch
from torch import nn


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
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x_BNTD: torch.Tensor, cos_B1TD: torch.Tensor, sin_B1TD: torch.Tensor) -> torch.Tensor:
    d = x_BNTD.shape[-1]
    cos, sin = cos_B1TD.to(x_BNTD.dtype), sin_B1TD.to(x_BNTD.dtype)
    x1, x2 = x_BNTD[..., : d // 2], x_BNTD[..., d // 2 :]
    return x_BNTD * cos + torch.cat([-x2, x1], dim=-1) * sin


def repeat_kv(x_BNTD: torch.Tensor, num_heads: int) -> torch.Tensor:
    rep = num_heads // x_BNTD.shape[1]
    return x_BNTD if rep == 1 else x_BNTD.repeat_interleave(rep, dim=1)
