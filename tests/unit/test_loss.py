"""Teacher, forward-KL loss and metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from eagle3_dagster.drafter.loss import (
    acceptance_length,
    build_teacher,
    step_loss,
    step_weights,
    teacher_for_step,
)


def _teacher_setup():
    # target vocab 4, draft vocab = target ids {0, 2}; lm_head = identity so logits = last_hidden
    t2d = torch.tensor([True, False, True, False])
    lm_head = torch.eye(4)
    last = torch.tensor([[[2.0, 0.0, 1.0, 0.0],    # argmax 0 (in draft vocab)
                          [0.0, 3.0, 1.0, 0.0],    # argmax 1 (outside): never valid
                          [0.0, 0.0, 1.0, 0.0],    # argmax 2 (in draft vocab)
                          [1.0, 0.0, 0.0, 0.0]]])  # last row: no next token to supervise
    loss_mask = torch.tensor([[0, 1, 1, 1]])
    return build_teacher(last, loss_mask, lm_head, t2d)


def test_teacher_restricts_logits_to_draft_vocab_before_softmax():
    teacher = _teacher_setup()
    p0 = teacher.logp_BTV[0, 0].exp()
    want = torch.softmax(torch.tensor([2.0, 1.0]), -1)
    torch.testing.assert_close(p0, want)
    assert teacher.argmax_BT[0].tolist() == [0, 1, 1, 0]
    # row i is valid iff loss_mask[i+1] and the full-vocab argmax is a draft token
    assert teacher.valid_BT[0].tolist() == [True, False, True, False]


def test_step_loss_is_forward_kl_averaged_over_valid_positions():
    teacher = _teacher_setup()
    logits = torch.tensor([[[0.0, 0.5], [5.0, 0.0], [1.0, 3.0], [0.0, 0.0]]], requires_grad=True)
    r = step_loss(logits, teacher)
    # by hand: row 0: p = softmax([2,1]), q = softmax([0,.5]); row 2: p = softmax([0,1]), q = softmax([1,3])
    e = math.e
    p0 = [e / (e + 1), 1 / (e + 1)]
    q2 = [e / (e + e**3), e**3 / (e + e**3)]
    p2 = [1 / (1 + e), e / (1 + e)]
    q0 = [1 / (1 + e**0.5), e**0.5 / (1 + e**0.5)]
    kl0 = sum(p * math.log(p / q) for p, q in zip(p0, q0))
    kl2 = sum(p * math.log(p / q) for p, q in zip(p2, q2))
    assert r.loss.item() == pytest.approx((kl0 + kl2) / 2, rel=1e-5)
    assert r.num_valid == 2
    assert r.num_correct == 1  # row 0: student 1 vs teacher 0; row 2: both 1
    r.loss.backward()
    assert logits.grad[0, 1].abs().sum() == 0 and logits.grad[0, 3].abs().sum() == 0  # invalid rows get no gradient


def test_teacher_for_step_shifts_rows_by_one_plus_step():
    teacher = _teacher_setup()
    s1 = teacher_for_step(teacher, 1)  # position t reads row t + 2
    assert s1.valid_BT[0].tolist() == [True, False, False, False]
    torch.testing.assert_close(s1.logp_BTV[0, 0], teacher.logp_BTV[0, 2])
    assert not teacher_for_step(teacher, 5).valid_BT.any()


def test_step_weights_and_simulated_acceptance_length():
    assert step_weights(3) == pytest.approx([1.0, 0.8, 0.64])
    assert acceptance_length([0.8, 0.5, 0.5]) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert acceptance_length([0.8, 0.5, 0.5], bonus=False) == pytest.approx(0.8 + 0.4 + 0.2)
