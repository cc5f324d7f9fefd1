"""Training-time test (TTT): the drafter unrolled over k draft steps on one sequence.

At step j the drafter sees ids shifted by j and, as hidden, its own output of
step j-1; the query at position t attends causally to the step-0 keys 0..t plus
the same-position key of every later step 1..j — exactly the keys it would see
at serve time after j draft steps from position t.

The attention never materialises an L×(L+k) mask or score matrix: the causal
part is computed in query blocks under activation checkpointing (each block
returns its output and logsumexp; backward recomputes one block at a time), the
same-position keys are elementwise (diagonal) scores, and the two are joined
through their logsumexp. Memory per step is linear in sequence length for a
fixed block size; SpecForge's sdpa path and EAGLE's reference instead hold
(B, heads, L, L+k) fp32 weights for every step (AngelSlim #288).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eagle3_dagster.drafter.model import Eagle3Drafter, repeat_kv

DEFAULT_BLOCK = 512


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Scores and softmax in at least fp32 (bf16 logsumexp loses the diagonal keys' weight)."""
    return torch.promote_types(x.dtype, torch.float32)


def _causal_block(q_b: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries start..start+n over keys 0..start+n-1 (causal); returns (out, logsumexp) in >= fp32."""
    n, acc = q_b.shape[2], _acc_dtype(q_b)
    scores = torch.matmul(q_b.to(acc), k.to(acc).transpose(-1, -2)) / math.sqrt(q_b.shape[-1])
    q_pos = torch.arange(start, start + n, device=q_b.device)[:, None]
    k_pos = torch.arange(k.shape[2], device=q_b.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.to(acc))
    return out, lse


def causal_attention_with_lse(
    q_BNTD: torch.Tensor, k_BNTD: torch.Tensor, v_BNTD: torch.Tensor, block: int = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention that also returns the per-query logsumexp, blockwise and recomputed in backward."""
    outs, lses = [], []
    t = q_BNTD.shape[2]
    for start in range(0, t, block):
        end = min(start + block, t)
        args = (q_BNTD[:, :, start:end], k_BNTD[:, :, :end], v_BNTD[:, :, :end], start)
        if torch.is_grad_enabled() and any(x.requires_grad for x in args[:3]):
            o, lse = checkpoint(_causal_block, *args, use_reentrant=False)
        else:
            o, lse = _causal_block(*args)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def ttt_attention(
    q_BNTD: torch.Tensor,
    k0_BNTD: torch.Tensor,
    v0_BNTD: torch.Tensor,
    extra_k: list[torch.Tensor],
    extra_v: list[torch.Tensor],
    block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Attention of step j = len(extra_k): causal over step-0 keys, plus each later step's same-position key.

    All inputs have the query's head count (GQA already expanded). Output in q's dtype.
    """
    if not extra_k:
        return F.scaled_dot_product_attention(q_BNTD, k0_BNTD, v0_BNTD, is_causal=True)
    out0, lse0 = causal_attention_with_lse(q_BNTD, k0_BNTD, v0_BNTD, block)
    acc = _acc_dtype(q_BNTD)
    q32 = q_BNTD.to(acc)
    scale = 1.0 / math.sqrt(q_BNTD.shape[-1])
    diag = torch.stack([(q32 * k.to(acc)).sum(-1) * scale for k in extra_k], dim=-1)  # [B,N,T,j]
    lse = torch.logsumexp(torch.cat([lse0[..., None], diag], dim=-1), dim=-1, keepdim=True)
    out = torch.exp(lse0[..., None] - lse) * out0
    weights = torch.exp(diag - lse)
    for i, v in enumerate(extra_v):
        out = out + weights[..., i : i + 1] * v.to(acc)
    return out.to(q_BNTD.dtype)


def shift_left(x_BT: torch.Tensor, n: int, fill: int | float = 0) -> torch.Tensor:
    """x[:, t + n] at position t, `fill` past the end."""
    if n == 0:
        return x_BT
    pad = torch.full_like(x_BT[:, :n], fill)
    return torch.cat([x_BT[:, n:], pad], dim=1)


def ttt_unroll(
    model: Eagle3Drafter,
    input_ids_BT: torch.Tensor,
    aux_hidden_BT3H: torch.Tensor,
    num_steps: int,
    position_ids_BT: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
) -> Iterator[torch.Tensor]:
    """Yield the draft logits [B,T,V_draft] of steps 0..num_steps-1.

    `input_ids_BT` are the sample's own token ids: position t of step j gets
    token t+1+j (EAGLE's `padding(input_ids, left=False)` applied j+1 times),
    with RoPE position t+j, as at serve time. Callers consume one step's logits
    (loss) before asking for the next, so logits of earlier steps are not kept.
    """
    b, t = input_ids_BT.shape
    if position_ids_BT is None:
        position_ids_BT = torch.arange(t, device=input_ids_BT.device).expand(b, t)
    nq = model.cfg.num_attention_heads
    hidden = model.project_aux(aux_hidden_BT3H)
    k0 = v0 = None
    extra_k: list[torch.Tensor] = []
    extra_v: list[torch.Tensor] = []
    for j in range(num_steps):
        ids = shift_left(input_ids_BT, 1 + j)
        embeds = model.embed_tokens(ids).to(hidden.dtype)
        q, k, v = model.midlayer.qkv(embeds, hidden, position_ids_BT + j)
        k, v = repeat_kv(k, nq), repeat_kv(v, nq)
        if j == 0:
            k0, v0 = k, v
        else:
            extra_k.append(k)
            extra_v.append(v)
        attn = ttt_attention(q, k0, v0, extra_k, extra_v, block)
        hidden = model.midlayer.finish(attn, hidden)
        yield model.logits(hidden)
