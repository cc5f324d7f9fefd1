"""The TTT objective as it was before the fused teacher pass (commit f2da7bd), kept verbatim as the benchmark baseline.

`benchmarks/ttt_step.py` measures the current objective against this one in the
same run. Copied from eagle3_dagster/drafter/ttt.py and loss.py at that commit
(blockwise recomputed causal attention; per-step [tokens, draft_vocab] logits
and a whole-sequence teacher log-prob tensor) plus the forward of the
`TTTObjective` of eagle3_dagster/train/loop.py. Not used by the pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

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


STEP_WEIGHT_DECAY = 0.8  # EAGLE main.py `ploss_weight = [0.8 ** i ...]`


@dataclass
class Teacher:
    """Per teacher row i: log-probs over the draft vocab and whether the row is a valid target."""

    logp_BTV: torch.Tensor  # fp32 [B, T, V_draft]
    argmax_BT: torch.Tensor  # draft id of the teacher's argmax
    valid_BT: torch.Tensor  # bool: supervised next token AND full-vocab argmax inside the draft vocab


@torch.no_grad()
def build_teacher(
    last_hidden_BTH: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    t2d: torch.Tensor,
    chunk_rows: int = 1024,
) -> Teacher:
    """Teacher rows from the target's last hidden, in row chunks so the full-vocab logits stay small."""
    b, t, h = last_hidden_BTH.shape
    flat = last_hidden_BTH.reshape(b * t, h)
    draft_cols = t2d.nonzero().squeeze(-1)
    w = lm_head_weight_VH.to(flat.device)
    logps, argmaxes, inside = [], [], []
    for s in range(0, flat.shape[0], chunk_rows):
        logits = (flat[s : s + chunk_rows].to(w.dtype) @ w.T).float()
        inside.append(t2d[logits.argmax(-1)])
        draft_logits = logits[:, draft_cols]
        logps.append(F.log_softmax(draft_logits, dim=-1))
        argmaxes.append(draft_logits.argmax(-1))
    logp = torch.cat(logps).view(b, t, -1)
    supervised_next = torch.cat(
        [loss_mask_BT[:, 1:].bool(), torch.zeros_like(loss_mask_BT[:, :1], dtype=torch.bool)], 1
    )
    valid = torch.cat(inside).view(b, t) & supervised_next
    return Teacher(logp_BTV=logp, argmax_BT=torch.cat(argmaxes).view(b, t), valid_BT=valid)


def teacher_for_step(teacher: Teacher, step: int) -> Teacher:
    """Teacher rows aligned with drafter positions at TTT step `step` (row t+1+step at position t)."""
    n = 1 + step
    t = teacher.valid_BT.shape[1]
    if n >= t:
        z = teacher.valid_BT.new_zeros(teacher.valid_BT.shape)
        return Teacher(teacher.logp_BTV, teacher.argmax_BT, z)

    def sh(x: torch.Tensor, fill) -> torch.Tensor:
        pad = torch.full_like(x[:, :n], fill)
        return torch.cat([x[:, n:], pad], dim=1)

    return Teacher(sh(teacher.logp_BTV, 0.0), sh(teacher.argmax_BT, 0), sh(teacher.valid_BT, False))


@dataclass
class StepResult:
    loss: torch.Tensor  # differentiable mean forward KL over valid positions
    num_valid: int
    num_correct: int
    kl_sum: float  # detached sum over valid positions (for exact cross-rank means)


def step_loss(draft_logits_BTV: torch.Tensor, teacher: Teacher) -> StepResult:
    """Forward KL(teacher || drafter) summed over the draft vocab, averaged over valid positions."""
    logq = F.log_softmax(draft_logits_BTV.float(), dim=-1)
    p = teacher.logp_BTV.exp()
    kl = (torch.xlogy(p, p) - p * logq).sum(-1)  # xlogy: 0·log 0 = 0
    valid = teacher.valid_BT
    n = int(valid.sum())
    masked = torch.where(valid, kl, torch.zeros_like(kl))
    loss = masked.sum() / max(n, 1)
    correct = int(((draft_logits_BTV.argmax(-1) == teacher.argmax_BT) & valid).sum())
    return StepResult(loss=loss, num_valid=n, num_correct=correct, kl_sum=float(masked.detach().sum()))


def objective(
    drafter: Eagle3Drafter, target_lm_head_VH, ttt_steps, input_ids_BT, loss_mask_BT, aux_hidden_BT3H, last_hidden_BTH
):
    """`TTTObjective.forward` at that commit: weighted loss and per-step (kl_sum, num_valid, num_correct)."""
    weights = [STEP_WEIGHT_DECAY**j for j in range(ttt_steps)]
    teacher = build_teacher(last_hidden_BTH, loss_mask_BT, target_lm_head_VH, drafter.t2d)
    total = aux_hidden_BT3H.new_zeros((), dtype=torch.float32)
    stats = []
    for j, logits in enumerate(ttt_unroll(drafter, input_ids_BT, aux_hidden_BT3H, ttt_steps)):
        r = step_loss(logits, teacher_for_step(teacher, j))
        total = total + weights[j] * r.loss
        stats.append([r.kl_sum, r.num_valid, r.num_correct])
    return total, torch.tensor(stats, dtype=torch.float64)
