"""The teacher distribution, the TTT loss and its metrics, fused with the drafter's lm_head.

Teacher: the target's own next-token distribution, `lm_head_target(last_hidden)`
(shards store the post-norm last hidden, so lm_head applies directly),
restricted to the draft vocabulary *before* the softmax (EAGLE `cnets.py`,
SpecForge `_compute_target_p`). Positions whose full-vocab argmax lies outside
the draft vocabulary can never be drafted correctly and are left out.

Alignment. The teacher row i is the target's distribution over token i+1. The
drafter at position t, TTT step j, predicts token t+2+j, so it is taught by
teacher row i = t+1+j. A row counts when the token it predicts is supervised
(`loss_mask[i+1] == 1`: the target generated it) — the tokens the drafter
will be asked to draft at serve time. (EAGLE/SpecForge use `loss_mask[t+j]`,
two positions earlier; only turn boundaries differ.)

Memory and work. Nothing of size [tokens, draft_vocab] lives across a
training step: `build_teacher` keeps only the per-row argmax and validity (one
chunked pass over the full target vocab, supervised rows only), and
`ttt_loss` walks the *valid* teacher rows in chunks (a row that is not valid
carries no loss, gradient or count at any step, so it costs nothing); per
chunk it recomputes the teacher's draft-vocab log-probs from the stored last
hidden once and serves every TTT step from them (row i teaches position i-1-j
of step j), running lm_head → log-softmax → KL → correctness for each step.
The gradient of forward KL w.r.t. the drafter logits is `q - p`, so the
backward's matmuls (into the normed hidden and into lm_head) are done in the
same pass, as Liger's fused linear cross-entropy does; autograd's backward
then only scales them. The chunk is sized by `CHUNK_ELEMENTS` (larger on GPUs).

Acceptance length. SGLang's `accept_length` = completion_tokens /
verify_count counts the bonus token the target always contributes, so the
comparable simulated figure is `1 + Σ_j Π_{i≤j} acc_i`; that is
`sim_accept_length`. SpecForge's `simulated_acc_len` omits the +1 and is
reported as `sim_accept_length_no_bonus`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

STEP_WEIGHT_DECAY = 0.8  # EAGLE main.py `ploss_weight = [0.8 ** i ...]`
# Elements of one [rows, vocab] fp32 temporary (16 MiB): rows per chunk = this // vocab. The loss
# holds a handful of them per chunk; the teacher's full-vocab pass holds one, at 64 MiB, so its
# chunks stay long enough to amortise reading the whole target lm_head once per chunk.
CHUNK_ELEMENTS = 1 << 22
TEACHER_CHUNK_ELEMENTS = 1 << 24
# On a GPU small chunks mean thousands of tiny kernels and host syncs per micro-batch: 16× larger.
GPU_CHUNK_SCALE = 16
NO_DRAFT_MASS = "the LK loss needs the teacher's draft-vocab mass (build_teacher computes it)"


def _budget(elements: int, device: torch.device) -> int:
    return elements if device.type == "cpu" else elements * GPU_CHUNK_SCALE


def chunk_rows_for(vocab: int, num_rows: int, budget: int = CHUNK_ELEMENTS) -> int:
    return max(16, min(num_rows, budget // max(vocab, 1)))


def _span(idx: torch.Tensor) -> slice | None:
    """`idx` as a slice when it is a run of consecutive ids (the usual case), else None."""
    n = idx.numel()
    if n and int(idx[-1]) - int(idx[0]) + 1 == n:
        return slice(int(idx[0]), int(idx[0]) + n)
    return None


def _take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    span = _span(idx)
    return x[span] if span is not None else x.index_select(0, idx)


def _put_rows(dst: torch.Tensor, idx: torch.Tensor, value: torch.Tensor) -> None:
    """dst[idx] = value (ids unique); a slice copy for runs (CPU index kernels cost ~10 ms a call)."""
    span = _span(idx)
    if span is not None:
        dst[span] = value
    else:
        dst.index_copy_(0, idx, value.to(dst.dtype))


@dataclass
class Teacher:
    """What the loss needs of the target per row i (all O(tokens)); draft-vocab log-probs are recomputed."""

    last_hidden_BTH: torch.Tensor  # the target's post-norm last hidden
    draft_head_VdH: torch.Tensor  # the target lm_head's rows of the draft vocab (t2d order)
    argmax_BT: torch.Tensor  # draft id of the teacher's draft-vocab argmax
    valid_BT: torch.Tensor  # bool: supervised next token AND full-vocab argmax inside the draft vocab
    # log of the draft vocabulary's share of the full-vocab softmax, per row: the LK losses' acceptance
    # compares the draft with the target's own probabilities, not the renormalised teacher
    log_draft_mass_BT: torch.Tensor | None = None

    def logp_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Draft-vocab log-probs [n, V_draft] (fp32) of the flat (b·T + i) teacher rows `rows`."""
        w = self.draft_head_VdH
        hidden = _take_rows(self.last_hidden_BTH.reshape(-1, self.last_hidden_BTH.shape[-1]), rows)
        return F.log_softmax((hidden.to(w.dtype) @ w.T).float(), dim=-1)

    def draft_mass_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The draft vocabulary's share of the full-vocab softmax [n] of the flat teacher rows `rows` (LK only)."""
        if self.log_draft_mass_BT is None:
            raise ValueError(NO_DRAFT_MASS)
        return _take_rows(self.log_draft_mass_BT.flatten(), rows).exp()


def draft_rows(lm_head_weight_VH: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """The target lm_head restricted to the draft vocab: the teacher's logits are these columns."""
    return lm_head_weight_VH[t2d.to(lm_head_weight_VH.device)].contiguous()


@torch.no_grad()
def build_teacher(
    last_hidden_BTH: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    t2d: torch.Tensor,
    draft_head_VdH: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> Teacher:
    """Per-row argmax and validity from one chunked pass over the full target vocab (supervised rows only)."""
    b, t, h = last_hidden_BTH.shape
    flat = last_hidden_BTH.reshape(b * t, h)
    draft_cols = t2d.nonzero().squeeze(-1)
    w = lm_head_weight_VH.to(flat.device)
    supervised_next = torch.cat(
        [loss_mask_BT[:, 1:].bool(), torch.zeros_like(loss_mask_BT[:, :1], dtype=torch.bool)], 1
    )
    rows = supervised_next.flatten().nonzero().squeeze(-1)  # a row nothing learns from needs no logits
    argmax = torch.zeros(b * t, dtype=torch.long, device=flat.device)
    valid = torch.zeros(b * t, dtype=torch.bool, device=flat.device)
    log_mass = torch.zeros(b * t, dtype=torch.float32, device=flat.device)
    chunk = chunk_rows or chunk_rows_for(w.shape[0], max(1, rows.numel()), _budget(TEACHER_CHUNK_ELEMENTS, w.device))
    for s in range(0, rows.numel(), chunk):
        r = rows[s : s + chunk]
        logits = (flat[r].to(w.dtype) @ w.T).float()
        valid[r] = t2d[logits.argmax(-1)]
        draft_logits = logits[:, draft_cols]
        argmax[r] = draft_logits.argmax(-1)
        log_mass[r] = torch.logsumexp(draft_logits, -1) - torch.logsumexp(logits, -1)
        del logits, draft_logits
    head = draft_head_VdH if draft_head_VdH is not None else draft_rows(w, t2d)
    return Teacher(last_hidden_BTH, head, argmax.view(b, t), valid.view(b, t), log_mass.view(b, t))


def _mean_acceptance(
    weight_VH, teacher: Teacher, rows, row_pos, flat_x, chunk: int, num_valid: list[int]
) -> list[float]:
    """Per TTT step, the mean over valid rows of the expected acceptance Σ_v min(p_target(v), q_draft(v)) of
    speculative sampling (p_target: the target's full-vocab probabilities of the draft ids)."""
    k = len(flat_x)
    sums = [0.0] * k
    with torch.no_grad():
        for s in range(0, rows.numel(), chunk):
            r, i = rows[s : s + chunk], row_pos[s : s + chunk]
            a = teacher.logp_rows(r).exp_().mul_(teacher.draft_mass_rows(r)[:, None])
            for j in range(k):
                keep = i >= 1 + j
                if not bool(keep.any()):
                    continue
                x = _take_rows(flat_x[j], r[keep] - 1 - j)
                q = torch.softmax((x @ weight_VH.T).float(), dim=-1)
                sums[j] += float(torch.minimum(q, a[keep]).sum())
    return [sm / n if n else 0.0 for sm, n in zip(sums, num_valid)]


def _lk_grad(q: torch.Tensor, p: torch.Tensor, a: torch.Tensor, kl_scale: float, accept_scale: float) -> torch.Tensor:
    """d/dlogits of kl_scale · KL(p ‖ q) + accept_scale · (1 - Σ_v min(a_v, q_v)), q = softmax(logits).

    With S = {v : q_v < a_v} (where min picks q), d Σ_{v∈S} q_v / dz_i = q_i (1[i∈S] - q(S))."""
    below = q < a
    q_s = (q * below).sum(-1, keepdim=True)
    return (q - p).mul_(kl_scale).sub_(q * (below.to(q.dtype) - q_s) * accept_scale)


class _FusedHeadKL(torch.autograd.Function):
    """Σ_j w_j · mean over valid rows of KL(teacher ‖ softmax(lm_head(normed_j))); see the module docstring."""

    @staticmethod
    def forward(
        ctx,
        weight_VH,
        teacher: Teacher,
        step_weights: list[float],
        chunk: int,
        need_grad: bool,
        lk: tuple[float, float] | None,
        *normed,
    ):
        k = len(normed)
        b, t, h = normed[0].shape
        device = normed[0].device
        # Only valid teacher rows carry loss or gradient: walk them, compacted (flat ids b·T + i).
        rows = teacher.valid_BT.flatten().nonzero().squeeze(-1)
        row_pos = rows % t
        num_valid = [int((row_pos >= 1 + j).sum()) for j in range(k)]  # step j: row i teaches position i-1-j
        scales = [w / max(n, 1) for w, n in zip(step_weights, num_valid)]
        flat_x = [x.reshape(b * t, h) for x in normed]
        argmax = teacher.argmax_BT.flatten()
        kl_sums = torch.zeros(k, dtype=torch.float64, device=device)
        correct = torch.zeros(k, dtype=torch.int64, device=device)
        grad_w = torch.zeros_like(weight_VH, dtype=torch.float32) if need_grad else None
        grad_x = [torch.zeros(b * t, h, dtype=torch.float32, device=device) for _ in normed] if need_grad else []
        # LK lambda: step j's KL weight comes from its mean acceptance over every valid row, so a first pass
        # measures that (one lm_head matmul per chunk and step) before the pass that forms the gradient
        alpha = _mean_acceptance(weight_VH, teacher, rows, row_pos, flat_x, chunk, num_valid) if lk else []
        kl_weight = [lk[0] * math.exp(-lk[1] * a) for a in alpha] if lk else None
        for s in range(0, rows.numel(), chunk):
            r, i = rows[s : s + chunk], row_pos[s : s + chunk]
            p = teacher.logp_rows(r).exp_()
            neg_entropy = torch.xlogy(p, p).sum(-1)  # xlogy: 0·log 0 = 0
            for j in range(k):
                keep = i >= 1 + j
                if not bool(keep.any()):
                    continue
                all_kept = bool(keep.all())
                pos = (r if all_kept else r[keep]) - 1 - j  # same sequence: i-1-j >= 0
                p_j = p if all_kept else p[keep]
                x = _take_rows(flat_x[j], pos)
                logits = (x @ weight_VH.T).float()
                logq = F.log_softmax(logits, dim=-1)
                ent = neg_entropy if all_kept else neg_entropy[keep]
                kl_sums[j] += (ent - torch.linalg.vecdot(p_j, logq)).sum()
                correct[j] += (logits.argmax(-1) == argmax[r if all_kept else r[keep]]).sum()
                if need_grad and kl_weight is not None:
                    a = p_j * teacher.draft_mass_rows(r if all_kept else r[keep])[:, None]
                    g = _lk_grad(logq.exp_(), p_j, a, scales[j] * kl_weight[j], scales[j] * (1 - kl_weight[j])).to(
                        weight_VH.dtype
                    )
                elif need_grad:
                    g = logq.exp_().sub_(p_j).mul_(scales[j]).to(weight_VH.dtype)  # dKL/dlogits = q - p
                if grad_w is not None:  # need_grad
                    # row i is the only one teaching position i-1-j at step j: a put, not an add
                    _put_rows(grad_x[j], pos, g @ weight_VH)
                    grad_w += g.T @ x.to(g.dtype)
                del logits, logq
        stats = torch.stack([kl_sums.cpu(), torch.tensor(num_valid, dtype=torch.float64), correct.cpu().double()], 1)
        loss = sum(sc * kl for sc, kl in zip(scales, stats[:, 0].tolist()))
        if kl_weight is not None:  # Σ_j w_j · [λ_j KL_j + (1 - λ_j)(1 - ᾱ_j)]
            loss = sum(
                sc * lam * kl + w * (1 - lam) * (1 - a)
                for sc, lam, kl, w, a, n in zip(scales, kl_weight, stats[:, 0].tolist(), step_weights, alpha, num_valid)
                if n
            )
        ctx.save_for_backward(*([grad_w, *grad_x] if need_grad else []))
        ctx.dtypes, ctx.shapes = [x.dtype for x in normed], [x.shape for x in normed]
        ctx.mark_non_differentiable(stats)
        return torch.tensor(loss, dtype=torch.float32, device=device), stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_stats):
        grad_w, *grad_x = ctx.saved_tensors
        return (
            grad_w * grad_loss,
            None,
            None,
            None,
            None,
            None,
            *[(g * grad_loss).to(dt).view(shape) for g, dt, shape in zip(grad_x, ctx.dtypes, ctx.shapes)],
        )


def ttt_loss(
    normed_hiddens: list[torch.Tensor],
    lm_head_weight_VdH: torch.Tensor,
    teacher: Teacher,
    weights: list[float] | None = None,
    chunk_rows: int | None = None,
    lk: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted TTT loss over the steps' normed drafter outputs [B,T,H] and per-step (kl_sum, num_valid, num_correct).

    `lk = (kl_scale, kl_decay)` trains SpecForge's LK "lambda" objective instead of plain KL: per step
    λ·KL + (1 - λ)(1 - ᾱ), ᾱ the mean expected acceptance over the step's valid rows (of this rank) and
    λ = kl_scale · exp(-kl_decay · ᾱ), held constant for the gradient (specforge/core/lk_loss.py)."""
    weights = weights if weights is not None else step_weights(len(normed_hiddens))
    b, t = normed_hiddens[0].shape[:2]
    chunk = chunk_rows or chunk_rows_for(
        lm_head_weight_VdH.shape[0], max(1, b * t), _budget(CHUNK_ELEMENTS, lm_head_weight_VdH.device)
    )
    need_grad = torch.is_grad_enabled() and (
        lm_head_weight_VdH.requires_grad or any(x.requires_grad for x in normed_hiddens)
    )
    if lk is not None and teacher.log_draft_mass_BT is None:
        raise ValueError(NO_DRAFT_MASS)
    return _FusedHeadKL.apply(lm_head_weight_VdH, teacher, list(weights), chunk, need_grad, lk, *normed_hiddens)


def step_weights(num_steps: int, decay: float = STEP_WEIGHT_DECAY) -> list[float]:
    return [decay**j for j in range(num_steps)]


def acceptance_length(accs: list[float], bonus: bool = True) -> float:
    """Σ_j Π_{i≤j} acc_i (+1 for the target's bonus token, SGLang's convention)."""
    total, prod = 0.0, 1.0
    for a in accs:
        prod *= a
        total += prod
    return total + (1.0 if bonus else 0.0)
