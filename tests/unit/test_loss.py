"""Teacher, forward-KL loss and metrics: hand-computed values, and the fused chunked loss against a naive reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eagle3_dagster.drafter.loss import acceptance_length, build_teacher, step_weights, ttt_loss
from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_dagster.train.loop import TTTObjective


def _teacher_setup(draft_head=None):
    # target vocab 4, draft vocab = target ids {0, 2}; lm_head = identity so logits = last_hidden
    t2d = torch.tensor([True, False, True, False])
    lm_head = torch.eye(4)
    last = torch.tensor(
        [
            [
                [2.0, 0.0, 1.0, 0.0],  # argmax 0 (in draft vocab)
                [0.0, 3.0, 1.0, 0.0],  # argmax 1 (outside): never valid
                [0.0, 0.0, 1.0, 0.0],  # argmax 2 (in draft vocab)
                [1.0, 0.0, 0.0, 0.0],
            ]
        ]
    )  # last row: no next token to supervise
    loss_mask = torch.tensor([[0, 1, 1, 1]])
    return build_teacher(last, loss_mask, lm_head, t2d, draft_head_VdH=draft_head)


def test_teacher_restricts_logits_to_draft_vocab_before_softmax():
    teacher = _teacher_setup()
    p0 = teacher.logp_rows(torch.tensor([0]))[0].exp()
    want = torch.softmax(torch.tensor([2.0, 1.0]), -1)
    torch.testing.assert_close(p0, want)
    assert teacher.argmax_BT[0].tolist() == [0, 1, 1, 0]
    # row i is valid iff loss_mask[i+1] and the full-vocab argmax is a draft token
    assert teacher.valid_BT[0].tolist() == [True, False, True, False]


def test_loss_is_forward_kl_averaged_over_valid_positions_with_row_i_teaching_position_i_minus_one():
    # one TTT step; draft lm_head = identity, so the drafter's logits at position t are normed[t]
    # teacher rows 1..3 teach positions 0..2 (row 0 teaches nothing); valid rows are 0 and 2, so only
    # position 1 (taught by row 2) counts
    teacher = _teacher_setup()
    normed = torch.tensor([[[5.0, 0.0], [1.0, 3.0], [0.0, 0.5], [9.0, 9.0]]], requires_grad=True)
    head = torch.eye(2, requires_grad=True)
    loss, stats = ttt_loss([normed], head, teacher, [1.0])
    e = math.e
    p2, q1 = [1 / (1 + e), e / (1 + e)], [e / (e + e**3), e**3 / (e + e**3)]
    kl = sum(p * math.log(p / q) for p, q in zip(p2, q1))
    assert loss.item() == pytest.approx(kl, rel=1e-5)
    assert stats.tolist() == [[pytest.approx(kl, rel=1e-5), 1.0, 1.0]]  # kl_sum, num_valid, num_correct
    loss.backward()
    q = torch.softmax(torch.tensor([1.0, 3.0]), -1)
    torch.testing.assert_close(normed.grad[0, 1], q - torch.tensor(p2))  # dKL/dlogits = q - p
    assert normed.grad[0, [0, 2, 3]].abs().sum() == 0  # positions taught by invalid or no rows get no gradient


def test_step_weights_and_simulated_acceptance_length():
    assert step_weights(3) == pytest.approx([1.0, 0.8, 0.64])
    assert acceptance_length([0.8, 0.5, 0.5]) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert acceptance_length([0.8, 0.5, 0.5], bonus=False) == pytest.approx(0.8 + 0.4 + 0.2)


# ---- the implementation before the fused teacher pass, kept as the naive reference: whole-sequence teacher log-probs,
# full [B, T, V_draft] logits per step, autograd through log_softmax.


def naive_teacher(last_hidden, loss_mask, lm_head, t2d):
    logits = (last_hidden @ lm_head.T).float()
    draft = logits[..., t2d.nonzero().squeeze(-1)]
    supervised_next = torch.cat([loss_mask[:, 1:].bool(), torch.zeros_like(loss_mask[:, :1], dtype=torch.bool)], 1)
    return F.log_softmax(draft, -1), draft.argmax(-1), t2d[logits.argmax(-1)] & supervised_next


def naive_objective(drafter, lm_head, num_steps, ids, loss_mask, aux, last):
    from eagle3_dagster.drafter.ttt import ttt_unroll

    logp, argmax, valid = naive_teacher(last, loss_mask, lm_head, drafter.t2d)
    total, stats = 0.0, []
    for j, normed in enumerate(ttt_unroll(drafter, ids, aux, num_steps, fused=False, recompute_mlp=False)):
        logits = drafter.lm_head(normed)
        n = 1 + j
        sh = lambda x, fill: torch.cat([x[:, n:], torch.full_like(x[:, :n], fill)], 1)  # noqa: E731  (a one-line helper of this test)
        p_logp, p_arg, p_valid = sh(logp, 0.0), sh(argmax, 0), sh(valid, False)
        logq = F.log_softmax(logits.float(), -1)
        p = p_logp.exp()
        kl = (torch.xlogy(p, p) - p * logq).sum(-1)
        num = int(p_valid.sum())
        masked = torch.where(p_valid, kl, torch.zeros_like(kl))
        total = total + 0.8**j * masked.sum() / max(num, 1)
        stats.append([float(masked.detach().sum()), num, int(((logits.argmax(-1) == p_arg) & p_valid).sum())])
    return total, torch.tensor(stats, dtype=torch.float64)


def _problem(seed=0, b=2, t=29, vocab=64, draft_vocab=24, all_valid=False):
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        target_hidden_size=12,
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layers=(1, 2, 3),
    )
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab)[:draft_vocab]] = True
    d2t = t2d.nonzero().squeeze(-1) - torch.arange(draft_vocab)
    drafter = Eagle3Drafter(cfg, torch.randn(vocab, 16), d2t, t2d).double()
    for p in drafter.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.3)
    lm_head = torch.randn(vocab, 12, dtype=torch.float64) * 2
    # the target mostly agrees with itself: make several argmaxes land in the draft vocab
    lm_head[t2d] += 1.5
    ids, mask = torch.randint(0, vocab, (b, t)), (torch.rand(b, t) > 0.3).long()
    aux, last = torch.randn(b, t, 36, dtype=torch.float64), torch.randn(b, t, 12, dtype=torch.float64)
    if all_valid:  # every row supervised and its argmax a draft token: chunks are runs of consecutive rows
        mask = torch.ones_like(mask)
        last = lm_head[t2d.nonzero().squeeze(-1)[torch.randint(0, draft_vocab, (b, t))]] * 10
    batch = (ids, mask, aux, last)
    return drafter, lm_head, batch


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk_rows", [5, 7, 1000])
@pytest.mark.parametrize("recompute_mlp", [False, True])
@pytest.mark.parametrize("all_valid", [False, True], ids=["some_rows_valid", "all_rows_valid"])
def test_fused_chunked_loss_equals_naive_reference_in_loss_metrics_and_gradients(chunk_rows, recompute_mlp, all_valid):
    drafter, lm_head, (ids, mask, aux, last) = _problem(all_valid=all_valid)
    num_steps = 4
    drafter.zero_grad()
    want_loss, want_stats = naive_objective(drafter, lm_head, num_steps, ids, mask, aux, last)
    want_loss.backward()
    want_grads = _grads(drafter)
    assert want_stats[:, 1].min() > 0 and want_stats[:, 2].sum() > 0  # valid rows and correct drafts exist
    if all_valid:
        assert want_stats[:, 1].tolist() == [2 * (29 - 2 - j) for j in range(num_steps)]  # last row: no next

    from eagle3_dagster.drafter.ttt import ttt_unroll

    drafter.zero_grad()
    teacher = build_teacher(last, mask, lm_head, drafter.t2d, chunk_rows=chunk_rows)
    normed = list(ttt_unroll(drafter, ids, aux, num_steps, recompute_mlp=recompute_mlp))
    loss, stats = ttt_loss(normed, drafter.lm_head.weight, teacher, step_weights(num_steps), chunk_rows=chunk_rows)
    loss.backward()
    torch.testing.assert_close(loss.double(), want_loss.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats, want_stats, rtol=1e-6, atol=1e-6)
    got_grads = _grads(drafter)
    assert got_grads.keys() == want_grads.keys() and "lm_head.weight" in got_grads
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_objective_keeps_nothing_of_size_tokens_times_draft_vocab_for_backward():
    """What autograd saves during the objective's forward: no tensor as large as [tokens, draft_vocab]."""
    b, t, draft_vocab = 1, 96, 48
    drafter, lm_head, (ids, mask, aux, last) = _problem(b=b, t=t, draft_vocab=draft_vocab)
    objective = TTTObjective(drafter, lm_head, ttt_steps=3)
    largest = []

    def pack(x):
        largest.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss, _ = objective(ids, mask, aux, last)
    assert largest, "nothing was saved: the hook saw no graph"
    # the drafter's own lm_head gradient [V_draft, H] is the largest allowed; H=16 < tokens
    assert max(largest) < b * t * draft_vocab, f"a saved tensor has {max(largest)} elements"
    loss.backward()


def test_objective_without_grad_returns_the_same_metrics():
    drafter, lm_head, (ids, mask, aux, last) = _problem()
    objective = TTTObjective(drafter, lm_head, ttt_steps=3)
    loss, stats = objective(ids, mask, aux, last)
    with torch.no_grad():
        loss_ng, stats_ng = objective(ids, mask, aux, last)
    torch.testing.assert_close(loss_ng, loss.detach())
    torch.testing.assert_close(stats_ng, stats)


def naive_lk_objective(drafter, lm_head, num_steps, ids, loss_mask, aux, last, kl_scale, kl_decay):
    """SpecForge's LK "lambda" (specforge/core/lk_loss.py) by autograd: per step λ·KL + (1 - λ)(1 - ᾱ), ᾱ the
    masked mean of Σ_v min(p_target(v), q(v)) over draft ids, p_target the full-vocab softmax, λ detached."""
    from eagle3_dagster.drafter.ttt import ttt_unroll

    logp, _, valid = naive_teacher(last, loss_mask, lm_head, drafter.t2d)
    full = F.softmax((last @ lm_head.T).float(), -1)[..., drafter.t2d.nonzero().squeeze(-1)]
    total = 0.0
    for j, normed in enumerate(ttt_unroll(drafter, ids, aux, num_steps, fused=False, recompute_mlp=False)):
        n = 1 + j
        sh = lambda x, fill: torch.cat([x[:, n:], torch.full_like(x[:, :n], fill)], 1)  # noqa: E731  (a one-line helper of this test)
        p_valid, p, a = sh(valid, False), sh(logp, 0.0).exp(), sh(full, 0.0)
        logq = F.log_softmax(drafter.lm_head(normed).float(), -1)
        num = max(int(p_valid.sum()), 1)
        kl = torch.where(p_valid, (torch.xlogy(p, p) - p * logq).sum(-1), 0.0).sum() / num
        alpha = torch.where(p_valid, torch.minimum(a, logq.exp()).sum(-1), 0.0).sum() / num
        lam = kl_scale * torch.exp(-kl_decay * alpha.detach())
        total = total + 0.8**j * (lam * kl + (1 - lam) * (1 - alpha))
    return total


@pytest.mark.parametrize("chunk_rows", [5, 1000])
def test_fused_lk_lambda_loss_equals_specforge_formula_by_autograd_in_loss_and_gradients(chunk_rows):
    from eagle3_dagster.drafter.ttt import ttt_unroll

    drafter, lm_head, (ids, mask, aux, last) = _problem(seed=3)
    num_steps, lk = 3, (1.0, 1.0)
    drafter.zero_grad()
    want = naive_lk_objective(drafter, lm_head, num_steps, ids, mask, aux, last, *lk)
    want.backward()
    want_grads = _grads(drafter)
    drafter.zero_grad()
    teacher = build_teacher(last, mask, lm_head, drafter.t2d, chunk_rows=chunk_rows)
    normed = list(ttt_unroll(drafter, ids, aux, num_steps))
    loss, _ = ttt_loss(normed, drafter.lm_head.weight, teacher, step_weights(num_steps), chunk_rows=chunk_rows, lk=lk)
    loss.backward()
    torch.testing.assert_close(loss.double(), want.double(), rtol=1e-6, atol=1e-6)
    got_grads = _grads(drafter)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-6, atol=1e-7, msg=name)
    # and it is not the plain KL's gradient
    drafter.zero_grad()
    plain, _ = ttt_loss(
        list(ttt_unroll(drafter, ids, aux, num_steps)),
        drafter.lm_head.weight,
        teacher,
        step_weights(num_steps),
        chunk_rows=chunk_rows,
    )
    plain.backward()
    assert not torch.allclose(_grads(drafter)["lm_head.weight"], got_grads["lm_head.weight"])
