"""Training-time test (TTT): the drafter unrolled over k draft steps on one sequence.

At step j the drafter sees ids shifted by j and, as hidden, its own output of
step j-1; the query at position t attends causally to the step-0 keys 0..t plus
the same-position key of every later step 1..j — exactly the keys it would see
at serve time after j draft steps from position t.

The attention never materialises an L×(L+k) mask or score matrix. The causal
part runs in the platform's fused kernel that also returns the per-query
logsumexp (`_scaled_dot_product_flash_attention_for_cpu` on CPU, the
memory-efficient kernel on CUDA); the same-position keys are elementwise
(diagonal) scores; the two partial softmaxes are merged through their
logsumexp. Backward calls the fused kernel's own backward with the *merged*
output and logsumexp: with those, the kernel's `P = exp(S - lse)` and
`D = rowsum(dO * out)` are the merged softmax's, so it returns exactly the
causal keys' share of the merged gradient (the identity ring attention rests
on); the diagonal keys' share is elementwise. Where no fused kernel exists the
causal part is computed in query blocks under activation checkpointing. Either
way memory per step is linear in sequence length; SpecForge's sdpa path and
EAGLE's reference instead hold (B, heads, L, L+k) fp32 weights for every step
(AngelSlim #288).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eagle3_dagster.drafter.model import Eagle3Drafter

DEFAULT_BLOCK = 512
RECOMPUTE_MLP_FROM_TOKENS = 4096


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Scores and softmax in at least fp32 (bf16 logsumexp loses the diagonal keys' weight)."""
    return torch.promote_types(x.dtype, torch.float32)


def has_fused_causal(q: torch.Tensor) -> bool:
    """Whether this device has a fused causal kernel that returns its logsumexp (and its backward)."""
    if q.device.type == "cpu":
        return q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    return q.device.type == "cuda" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _fused_forward(q, k, v) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(out, lse [B,N,T] fp32, what the backward needs besides out/lse) from the platform kernel."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        return out, lse, ()
    # CUDA: the memory-efficient kernel (any GPU, fp32 and bf16); it pads its logsumexp to a multiple of 32
    # queries, and its backward wants that padded tensor back
    out, lse_padded, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, True
    )
    return out, lse_padded[..., : q.shape[2]], (lse_padded, seed, offset)


def _fused_backward(grad_out, q, k, v, out, lse, extra) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse.to(torch.float32) if q.dtype != torch.float64 else lse, 0.0, True
        )
    lse_padded, seed, offset = extra
    lse_padded = lse_padded.clone()
    lse_padded[..., : q.shape[2]] = lse
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out.contiguous(), q, k, v, None, out, lse_padded, seed, offset, 0.0, [True, True, True, False], True
    )
    return dq, dk, dv


def _merge(q, out0, lse0, extra_k, extra_v) -> tuple[torch.Tensor, torch.Tensor]:
    """Join the causal part (out0, lse0) with the diagonal keys; returns (out, lse) in >= fp32."""
    acc = _acc_dtype(q)
    q32 = q.to(acc)
    scale = 1.0 / math.sqrt(q.shape[-1])
    diag = torch.stack([(q32 * k.to(acc)).sum(-1) * scale for k in extra_k], dim=-1)  # [B,N,T,j]
    lse = torch.logsumexp(torch.cat([lse0.to(acc)[..., None], diag], dim=-1), dim=-1)
    out = torch.exp(lse0.to(acc) - lse)[..., None] * out0.to(acc)
    probs = torch.exp(diag - lse[..., None])
    for i, v in enumerate(extra_v):
        out = out + probs[..., i : i + 1] * v.to(acc)
    return out, lse


class _FusedTTTAttention(torch.autograd.Function):
    """Causal keys through the fused kernel + diagonal keys, merged by logsumexp; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k0, v0, num_extra: int, *extra):
        extra_k, extra_v = extra[:num_extra], extra[num_extra:]
        out0, lse0, kernel_state = _fused_forward(q, k0, v0)
        out, lse = _merge(q, out0, lse0, extra_k, extra_v)
        out = out.to(q.dtype)
        ctx.num_extra, ctx.kernel_state = num_extra, kernel_state
        ctx.save_for_backward(q, k0, v0, out, lse, *extra)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, out, lse, *extra = ctx.saved_tensors
        n = ctx.num_extra
        extra_k, extra_v = extra[:n], extra[n:]
        grad_out = grad_out.contiguous()
        dq, dk0, dv0 = _fused_backward(grad_out, q, k0, v0, out, lse, ctx.kernel_state)
        acc = _acc_dtype(q)
        q32, g32 = q.to(acc), grad_out.to(acc)
        scale = 1.0 / math.sqrt(q.shape[-1])
        delta = (g32 * out.to(acc)).sum(-1)  # D = rowsum(dO * out), as the kernel computes it
        dq = dq.to(acc)
        grads_k, grads_v = [], []
        for k, v in zip(extra_k, extra_v):
            k32 = k.to(acc)
            p = torch.exp((q32 * k32).sum(-1) * scale - lse)  # merged softmax weight of this diagonal key
            ds = p * ((g32 * v.to(acc)).sum(-1) - delta)
            dq = dq + (ds * scale)[..., None] * k32
            grads_k.append(((ds * scale)[..., None] * q32).to(k.dtype))
            grads_v.append((p[..., None] * g32).to(v.dtype))
        return (dq.to(q.dtype), dk0, dv0, None, *grads_k, *grads_v)


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
    """Causal attention that also returns the per-query logsumexp, blockwise and recomputed in backward.

    The fallback for devices without a fused kernel that returns its logsumexp.
    """
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


def _common_head_size(q, k0, v0, extra_k, extra_v):
    """The fused kernels want one head size for q, k and v; MLA's values are narrower (or wider) than its
    queries. Zero-pad the narrower side (queries rescaled so the kernel's 1/sqrt(size) stays 1/sqrt(q's size))."""
    dq, dv = q.shape[-1], v0.shape[-1]
    if dv < dq:
        pad = (0, dq - dv)
        return q, k0, F.pad(v0, pad), extra_k, [F.pad(v, pad) for v in extra_v]
    pad = (0, dv - dq)
    return (F.pad(q * math.sqrt(dv / dq), pad), F.pad(k0, pad), v0, [F.pad(k, pad) for k in extra_k], extra_v)


def ttt_attention(
    q_BNTD: torch.Tensor,
    k0_BNTD: torch.Tensor,
    v0_BNTD: torch.Tensor,
    extra_k: list[torch.Tensor],
    extra_v: list[torch.Tensor],
    block: int = DEFAULT_BLOCK,
    fused: bool | None = None,
) -> torch.Tensor:
    """Attention of step j = len(extra_k): causal over step-0 keys, plus each later step's same-position key.

    All inputs have the query's head count (GQA already expanded); scores are scaled by 1/sqrt(q's head
    size), and values may have another head size (MLA). Output in q's dtype. `fused` None picks the fused
    kernel where the device has one; False forces the blockwise path.
    """
    if not extra_k:
        return F.scaled_dot_product_attention(q_BNTD, k0_BNTD, v0_BNTD, is_causal=True)
    if fused is None:
        fused = has_fused_causal(q_BNTD)
    if fused:
        dv = v0_BNTD.shape[-1]
        args = (q_BNTD, k0_BNTD, v0_BNTD, extra_k, extra_v)
        if dv != q_BNTD.shape[-1]:
            args = _common_head_size(*args)
        q, k0, v0, ks, vs = args
        return _FusedTTTAttention.apply(q, k0, v0, len(ks), *ks, *vs)[..., :dv]
    out0, lse0 = causal_attention_with_lse(q_BNTD, k0_BNTD, v0_BNTD, block)
    out, _ = _merge(q_BNTD, out0, lse0, extra_k, extra_v)
    return out.to(q_BNTD.dtype)


def ttt_unroll(
    model: Eagle3Drafter,
    input_ids_BT: torch.Tensor,
    aux_hidden_BT3H: torch.Tensor,
    num_steps: int,
    position_ids_BT: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
    fused: bool | None = None,
    recompute_mlp: bool | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the drafter's normed output [B,T,H] (what lm_head reads) of steps 0..num_steps-1.

    `input_ids_BT` are the sample's own token ids: position t of step j gets
    token t+1+j (EAGLE's `padding(input_ids, left=False)` applied j+1 times),
    with RoPE position t+j, as at serve time. `model.lm_head(x)` gives a step's
    draft logits; training instead hands the outputs to `loss.ttt_loss`, which
    applies lm_head chunk by chunk.

    `recompute_mlp` (default: from `RECOMPUTE_MLP_FROM_TOKENS` tokens on) keeps
    only the input of each step's post-attention half (norm, MLP, final norm)
    and recomputes it in backward: ~100 of the ~180 bytes per token·hidden unit
    a step keeps, for ~10% more compute at draft vocab 2k (less at larger
    vocabularies, where lm_head dominates). Short sequences, where compute
    rather than memory bounds the step, skip it.
    """
    b, t = input_ids_BT.shape
    if position_ids_BT is None:
        position_ids_BT = torch.arange(t, device=input_ids_BT.device).expand(b, t)
    if recompute_mlp is None:
        recompute_mlp = b * t >= RECOMPUTE_MLP_FROM_TOKENS
    recompute_mlp = recompute_mlp and torch.is_grad_enabled()
    cfg, layer = model.cfg, model.midlayer
    hidden = model.project_aux(aux_hidden_BT3H)
    # What `MidLayer.queries` computes, with the work that does not depend on the step done once. The
    # projection of cat(norm(embeds), norm(hidden)) (GQA's q/k/v, MLA's q_a and kv_a) is split into its
    # embedding half and its hidden half. Step j's tokens are window j of ids[1:] + num_steps pad ids, so
    # one pass over that window's T-1+k rows replaces k passes over T (embedding, input norm and half the
    # input projection, forward and backward). RoPE angles come from one table.
    a = layer.self_attn
    w_in = a.in_proj_weight()
    w_embed, w_hidden = w_in[:, : cfg.hidden_size], w_in[:, cfg.hidden_size :]
    ids_all = torch.cat([input_ids_BT[:, 1:], input_ids_BT.new_zeros(b, num_steps)], dim=1)
    embed_proj = F.linear(layer.input_layernorm(model.embed_tokens(ids_all).to(hidden.dtype)), w_embed)
    positions = torch.arange(int(position_ids_BT.max()) + num_steps, device=input_ids_BT.device)
    cos_table, sin_table = a.rope_tables(positions)
    keys: list[torch.Tensor] = []  # per step so far: step 0's are causal, each later one's same-position
    values: list[torch.Tensor] = []

    def tail(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = layer.mlp_block(h)
        return out, model.norm(out)

    for j in range(num_steps):
        proj = embed_proj[:, j : j + t] + F.linear(layer.hidden_norm(hidden), w_hidden)
        cos, sin = cos_table[position_ids_BT + j][:, None], sin_table[position_ids_BT + j][:, None]
        q, entry = a.split(proj, cos, sin)
        k, v = a.keys_values(entry)
        keys.append(k)
        values.append(v)
        attn = ttt_attention(q, keys[0], values[0], keys[1:], values[1:], block, fused)
        h = layer.attn_residual(attn, hidden)
        out, normed = checkpoint(tail, h, use_reentrant=False) if recompute_mlp else tail(h)
        hidden = model.carried(out, normed)
        yield normed
