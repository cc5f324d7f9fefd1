"""Speculative sampling is lossless: its output is distributed as plain sampling from the target.

The check is statistical against the exact distribution: on an 8-token target the
probability of every continuation of up to four tokens is computed from the target
itself, and seeded runs are compared with it by chi-square (cells of expected count
under 5 pooled) on the joint of the first two generated tokens and the marginals of
tokens 2, 3 and 4 (the ones that go through verification). Plain sampling and SGLang's
rule pass; two lossy rules fail the same check: greedy acceptance, and forgetting to
remove the rejected draft before the residual draw.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from eagle3_dagster.bench.specdec import (
    SpecConfig,
    TargetRunner,
    generate_sampled,
    generate_speculative,
    sample_from,
    verify_target_only,
)

V = 8
T = 0.8
PROMPT = [3, 5, 1, 6]
DEPTH = 4  # generated tokens per run: t1 from the prefill, t2 and t3 drafted, t4 a correction or the bonus
RUNS = 1200
PASS_P = 1e-3  # a lossless rule passes every statistic above this; a lossy one falls far below


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Thousands of tiny forwards: one thread is several times faster than a pool that spins between them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target() -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        n_routed_experts=2,
        num_experts_per_tok=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked, context-dependent distributions instead of near-uniform ones
    return model


@pytest.fixture(scope="module")
def exact(target) -> dict[tuple[int, ...], torch.Tensor]:
    """q(. | prompt + prefix) at temperature T for every prefix of fewer than DEPTH tokens."""
    out: dict[tuple[int, ...], torch.Tensor] = {}
    with torch.no_grad():
        for n in range(DEPTH):
            prefixes = list(itertools.product(range(V), repeat=n))
            ids = torch.tensor([PROMPT + list(p) for p in prefixes])
            probs = torch.softmax(target(input_ids=ids).logits[:, -1].double() / T, dim=-1)
            out.update({p: probs[i] for i, p in enumerate(prefixes)})
    return out


class TableProposer:
    """Drafts the target's most likely token at even depths and its second most likely at odd ones,
    so drafts are accepted and rejected in every position (no forward: read from the exact table)."""

    aux_layers: tuple[int, ...] = ()
    name = "table"

    def __init__(self, exact: dict[tuple[int, ...], torch.Tensor]) -> None:
        self.exact = exact

    def reset(self) -> None:
        pass

    def propose(self, tokens, new_aux_1T3H, k: int) -> list[int]:
        prefix = tuple(tokens[len(PROMPT) :])
        drafts: list[int] = []
        for _ in range(k):
            q = self.exact.get(prefix)
            if q is None:
                break
            drafts.append(int(q.argsort(descending=True)[len(prefix) % 2]))
            prefix += (drafts[-1],)
        return drafts


def _exact_tables(exact) -> dict[str, dict[tuple[int, ...], float]]:
    joint: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(V), repeat=DEPTH):
        p = 1.0
        for j in range(DEPTH):
            p *= float(exact[seq[:j]][seq[j]])
        joint[seq] = p
    tables: dict[str, dict[tuple[int, ...], float]] = {}
    for name, idx in (("t1,t2", (0, 1)), ("t2", (1,)), ("t3", (2,)), ("t4", (3,))):
        table: dict[tuple[int, ...], float] = {}
        for seq, p in joint.items():
            key = tuple(seq[i] for i in idx)
            table[key] = table.get(key, 0.0) + p
        tables[name] = table
    return tables


def _p_values(samples: list[list[int]], exact) -> dict[str, float]:
    """Chi-square goodness-of-fit p-value per statistic (cells expected < 5 pooled into one)."""
    out = {}
    n = len(samples)
    for name, table in _exact_tables(exact).items():
        idx = {"t1,t2": (0, 1), "t2": (1,), "t3": (2,), "t4": (3,)}[name]
        counts: dict[tuple[int, ...], int] = {}
        for s in samples:
            key = tuple(s[i] for i in idx)
            counts[key] = counts.get(key, 0) + 1
        big = [k for k, p in table.items() if p * n >= 5]
        observed = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
        expected = [table[k] * n for k in big] + [n - sum(table[k] * n for k in big)]
        if expected[-1] < 5:  # nothing left to pool: drop the empty cell
            observed, expected = observed[:-1], expected[:-1]
        stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
        dof = len(expected) - 1
        out[name] = float(
            torch.special.gammaincc(
                torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
            )
        )
    return out


def _speculative_samples(target, exact, verify, runs: int = RUNS) -> list[list[int]]:
    runner, proposer = TargetRunner(target), TableProposer(exact)
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(runs):
        gen = generate_speculative(
            runner, proposer, PROMPT, SpecConfig(3), DEPTH, temperature=T, generator=g, verify=verify
        )
        out.append(gen.output_ids)
    return out


def _greedy_acceptance(probs_KV, drafts, coins_K, final_coin):
    """Lossy: accept a draft when it is the target's argmax; otherwise draw from q."""
    for j, x in enumerate(drafts):
        if int(probs_KV[j].argmax()) != x:
            return j, sample_from(probs_KV[j], final_coin)
    return len(drafts), sample_from(probs_KV[len(drafts)], final_coin)


def _residual_keeps_the_rejected_draft(probs_KV, drafts, coins_K, final_coin):
    """Lossy: SGLang's acceptance test, but the correction is drawn from q itself instead of relu(q - p)."""
    for j, x in enumerate(drafts):
        if float(coins_K[j]) > float(probs_KV[j, x]):
            return j, sample_from(probs_KV[j], final_coin)
    return len(drafts), sample_from(probs_KV[len(drafts)], final_coin)


@pytest.mark.slow  # 1,200 seeded generations of a tiny target
def test_plain_sampling_passes_the_check_against_the_exact_distribution(target, exact):
    runner, g = TargetRunner(target), torch.Generator().manual_seed(99)
    samples = [generate_sampled(runner, PROMPT, DEPTH, temperature=T, generator=g).output_ids for _ in range(RUNS)]
    p = _p_values(samples, exact)
    assert min(p.values()) > PASS_P, p


@pytest.mark.slow  # 1,200 seeded speculative generations of a tiny target
def test_speculative_sampling_with_sglangs_rule_is_distributed_as_the_target(target, exact):
    samples = _speculative_samples(target, exact, verify_target_only)
    assert all(len(s) == DEPTH for s in samples)
    p = _p_values(samples, exact)
    assert min(p.values()) > PASS_P, p


@pytest.mark.slow  # 2 x 600 seeded speculative generations
@pytest.mark.parametrize("rule", [_greedy_acceptance, _residual_keeps_the_rejected_draft])
def test_a_lossy_verification_rule_fails_the_same_check(target, exact, rule):
    p = _p_values(_speculative_samples(target, exact, rule, runs=RUNS // 2), exact)
    assert min(p.values()) < 1e-5, p  # with half the runs the lossless rule gets


def test_the_check_exercises_rejections_and_full_acceptances_at_both_draft_positions(target, exact):
    runner, proposer, g = TargetRunner(target), TableProposer(exact), torch.Generator().manual_seed(7)
    accepted = [0, 0]
    proposed = [0, 0]
    for _ in range(100):
        gen = generate_speculative(runner, proposer, PROMPT, SpecConfig(3), DEPTH, temperature=T, generator=g)
        accepted = [a + b for a, b in zip(accepted, gen.accepted_by_position)]
        proposed = [a + b for a, b in zip(proposed, gen.proposed_by_position)]
    # DEPTH 4 leaves room for two drafts after the prefill's token: both are accepted and rejected at times,
    # and the second one's acceptances are the bonus-draw path
    assert all(0 < a < p for a, p in zip(accepted, proposed)), (accepted, proposed)


def test_sglang_rule_accepts_with_probability_q_and_draws_the_correction_without_the_draft():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)
    assert verify_target_only(probs, [0], torch.tensor([0.5, 0.0]), 0.99) == (1, 2)  # u <= q: accepted, bonus
    assert verify_target_only(probs, [0], torch.tensor([0.51, 0.0]), 0.0) == (0, 1)  # rejected: never token 0
    assert verify_target_only(probs, [0], torch.tensor([0.51, 0.0]), 0.99) == (0, 2)
    # threshold_acc 0.5 accepts what q / 0.5 covers (SGLang's relaxed, lossy option)
    assert verify_target_only(probs, [1], torch.tensor([0.59, 0.0]), 0.0, threshold_acc=0.5)[0] == 1
    assert verify_target_only(probs, [1], torch.tensor([0.59, 0.0]), 0.0)[0] == 0
