"""The teacher distribution, the TTT loss and its metrics.

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

Acceptance length. SGLang's `accept_length` = completion_tokens /
verify_count counts the bonus token the target always contributes, so the
comparable simulated figure is `1 + Σ_j Π_{i≤j} acc_i`; that is
`sim_accept_length`. SpecForge's `simulated_acc_len` omits the +1 and is
reported as `sim_accept_length_no_bonus`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    supervised_next = torch.cat([loss_mask_BT[:, 1:].bool(), torch.zeros_like(loss_mask_BT[:, :1], dtype=torch.bool)], 1)
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


def step_weights(num_steps: int, decay: float = STEP_WEIGHT_DECAY) -> list[float]:
    return [decay**j for j in range(num_steps)]


def acceptance_length(accs: list[float], bonus: bool = True) -> float:
    """Σ_j Π_{i≤j} acc_i (+1 for the target's bonus token, SGLang's convention)."""
    total, prod = 0.0, 1.0
    for a in accs:
        prod *= a
        total += prod
    return total + (1.0 if bonus else 0.0)
