"""The in-process speculative-decoding engine: exact greedy output and SGLang-style accounting."""

from __future__ import annotations


import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from eagle3_dagster.bench.proposers import Eagle3Proposer, NgramProposer
from tests.reference_proposers import AlwaysWrongProposer, OracleProposer
from tests.tiny_deepseek import VOCAB, decoding_target
from eagle3_dagster.bench.report import LengthBands
from eagle3_dagster.bench.specdec import (
    OutputMismatchError,
    SpecConfig,
    TargetRunner,
    check_identical,
    generate_greedy,
    generate_speculative,
    run_inprocess_benchmark,
)

AUX = (1, 2, 3)
MAX_NEW = 25


@pytest.fixture(scope="module")
def target() -> DeepseekV3ForCausalLM:
    return decoding_target()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 14)]


@pytest.fixture(scope="module")
def greedy(target, prompts) -> dict[tuple[int, ...], list[int]]:
    runner = TargetRunner(target)
    return {tuple(p): generate_greedy(runner, p, MAX_NEW).output_ids for p in prompts}


def _untrained_eagle(target) -> Eagle3Proposer:
    """The real drafter (eagle3_dagster.drafter.model), untrained, over a random half of the vocabulary."""
    from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter

    tc = target.config
    cfg = DrafterConfig.for_target(
        target_hidden_size=tc.hidden_size,
        target_intermediate_size=tc.intermediate_size,
        vocab_size=VOCAB,
        draft_vocab_size=48,
        aux_layers=AUX,
        num_attention_heads=2,
    )
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:48]] = True
    hot = t2d.nonzero().squeeze(-1)
    torch.manual_seed(3)
    drafter = Eagle3Drafter(cfg, target.get_input_embeddings().weight.detach(), hot - torch.arange(48), t2d).eval()
    return Eagle3Proposer(drafter, name="eagle3_untrained")


def test_greedy_reference_equals_transformers_generate(target, prompts, greedy):
    for p in prompts:
        out = target.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
        assert out[0, len(p) :].tolist() == greedy[tuple(p)]


@pytest.mark.parametrize("spec", [(3, 1, 4), (7, 1, 8)])
@pytest.mark.parametrize("method", ["ngram", "eagle3_untrained"])
def test_speculative_output_equals_target_greedy_output(target, prompts, greedy, method, spec):
    proposer = NgramProposer() if method == "ngram" else _untrained_eagle(target)
    runner = TargetRunner(target, proposer.aux_layers)
    for p in prompts:
        gen = generate_speculative(runner, proposer, p, SpecConfig.parse(spec), MAX_NEW)
        assert gen.output_ids == greedy[tuple(p)]
        assert gen.verify_tokens == MAX_NEW - 1  # every token but the prefill's comes from a verify step
        assert 1.0 <= gen.verify_tokens / gen.verify_ct <= spec[0] + 1


@pytest.mark.parametrize("spec", [(3, 1, 4), (7, 1, 8)])
def test_oracle_drafter_accepts_every_draft(target, prompts, greedy, spec):
    k = spec[0]
    max_new = 1 + 3 * (k + 1)  # the prefill token, then exactly three full verify steps
    oracle = OracleProposer(greedy)
    for p in prompts:
        gen = generate_speculative(TargetRunner(target), oracle, p, SpecConfig.parse(spec), max_new)
        assert gen.output_ids == greedy[tuple(p)][:max_new]
        assert gen.verify_ct == 3
        assert gen.verify_tokens / gen.verify_ct == k + 1
        assert gen.accepted_by_position == [3] * k


def test_oracle_at_the_max_new_tokens_boundary_drafts_only_what_fits(target, prompts, greedy):
    p = prompts[0]
    # 1 prefill token + 4 + 4 + 2: the last verify step may draft only one token.
    gen = generate_speculative(TargetRunner(target), OracleProposer(greedy), p, SpecConfig(3), 11)
    assert gen.output_ids == greedy[tuple(p)][:11]
    assert (gen.verify_ct, gen.verify_tokens) == (3, 10)
    assert gen.accepted_by_position == [3, 2, 2]
    assert gen.proposed_by_position == [3, 2, 2]


def test_always_wrong_drafter_gives_acceptance_length_one(target, prompts, greedy):
    wrong = AlwaysWrongProposer(greedy, VOCAB)
    for p in prompts:
        gen = generate_speculative(TargetRunner(target), wrong, p, SpecConfig(7, 1, 8), MAX_NEW)
        assert gen.output_ids == greedy[tuple(p)]
        assert gen.verify_tokens / gen.verify_ct == 1.0
        assert gen.accepted_by_position == [0] * 7


def test_generation_stops_at_eos_exactly_where_greedy_stops(target, prompts, greedy):
    p = prompts[1]
    ref = greedy[tuple(p)]
    eos = ref[6]
    expected = ref[: ref.index(eos) + 1]
    assert generate_greedy(TargetRunner(target), p, MAX_NEW, {eos}).output_ids == expected
    for proposer in (OracleProposer(greedy), NgramProposer(), _untrained_eagle(target)):
        runner = TargetRunner(target, proposer.aux_layers)
        gen = generate_speculative(runner, proposer, p, SpecConfig(3), MAX_NEW, {eos})
        assert gen.output_ids == expected


def test_ngram_proposer_continues_the_latest_match_of_the_longest_suffix():
    ngram = NgramProposer(max_ngram=2)
    assert ngram.propose([5, 6, 7, 8, 5, 6, 9, 9, 5, 6], None, 3) == [9, 9, 5]
    assert ngram.propose([1, 2, 3], None, 3) == []


def test_benchmark_rows_carry_acceptance_and_speedup_per_set_and_config(target, prompts, greedy):
    sets = {"a": [(f"p{i}", p) for i, p in enumerate(prompts[:2])], "b": [("q0", prompts[2])]}
    proposers = {"oracle": OracleProposer(greedy), "ngram": NgramProposer()}
    rows = run_inprocess_benchmark(target, sets, proposers, [SpecConfig(3)], MAX_NEW, rounds=2)
    by_key = {(r["set"], r["method"], r["spec"]): r for r in rows}
    assert set(by_key) == {
        (s, m, c) for s in "ab" for m, c in [("no_spec", None), ("oracle", "3,1,4"), ("ngram", "3,1,4")]
    }
    assert by_key[("a", "no_spec", None)]["speedup"] == 1.0
    assert all(
        len(r["wall_s_rounds"]) == 2 and r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        for r in rows
    )
    assert by_key[("a", "no_spec", None)]["completion_tokens"] == 2 * MAX_NEW
    oracle = by_key[("a", "oracle", "3,1,4")]
    assert oracle["acceptance_length"] == 4.0  # 24 tokens after the prefill token = 6 full verify steps per prompt
    assert oracle["accept_rate_by_position"][0] == 1.0


class _Recording:
    """Wraps a proposer and records which method drafted, in call order."""

    def __init__(self, inner, calls: list[str]) -> None:
        self.inner, self.calls, self.name, self.aux_layers = inner, calls, inner.name, inner.aux_layers

    def reset(self) -> None:
        self.calls.append(self.name)
        self.inner.reset()

    def propose(self, tokens, new_aux, k):
        return self.inner.propose(tokens, new_aux, k)


def test_every_method_is_warmed_up_then_timed_in_interleaved_rotating_rounds(target, prompts, greedy):
    calls: list[str] = []
    proposers = {"oracle": _Recording(OracleProposer(greedy), calls), "ngram": _Recording(NgramProposer(), calls)}
    sets = {"a": [(f"p{i}", p) for i, p in enumerate(prompts[:2])]}
    rows = run_inprocess_benchmark(target, sets, proposers, [SpecConfig(3)], 6, rounds=3)
    # one reset per generation: warm-up (one short generation each), then 3 rounds × 2 prompts each
    assert calls[:2] == ["oracle", "ngram"]
    timed = calls[2:]
    assert len(timed) == 3 * 2 * 2
    per_round = [timed[i : i + 4] for i in range(0, 12, 4)]
    # methods are [no_spec, oracle, ngram]; round r starts at method r: the order rotates
    assert per_round[0] == ["oracle", "oracle", "ngram", "ngram"]
    assert per_round[1] == ["oracle", "oracle", "ngram", "ngram"]  # [oracle, ngram, no_spec]
    assert per_round[2] == ["ngram", "ngram", "oracle", "oracle"]  # [ngram, no_spec, oracle]
    for r in rows:
        assert len(r["wall_s_rounds"]) == 3 and len(r["speedup_rounds"]) == 3
        assert r["speedup_min"] <= r["speedup"] <= r["speedup_max"]


def test_a_proposer_left_out_of_timing_runs_in_round_zero_only_and_keeps_its_acceptance(target, prompts, greedy):
    calls: list[str] = []
    proposers = {"oracle": _Recording(OracleProposer(greedy), calls), "ngram": _Recording(NgramProposer(), calls)}
    sets = {"a": [(f"p{i}", p) for i, p in enumerate(prompts[:2])]}
    timed_all = run_inprocess_benchmark(target, sets, proposers, [SpecConfig(3)], 6, rounds=3)
    calls.clear()
    rows = run_inprocess_benchmark(target, sets, proposers, [SpecConfig(3)], 6, rounds=3, timed_proposers={"oracle"})
    # warm-up (one each), then oracle in 3 rounds x 2 prompts, ngram in round 0 only
    assert calls.count("oracle") == 1 + 3 * 2 and calls.count("ngram") == 1 + 2
    by_method = {r["method"]: r for r in rows}
    assert by_method["ngram"]["timed_rounds"] == 1 and len(by_method["ngram"]["wall_s_rounds"]) == 1
    assert by_method["oracle"]["timed_rounds"] == 3 and len(by_method["oracle"]["speedup_rounds"]) == 3
    before = {r["method"]: r for r in timed_all}
    for method in ("oracle", "ngram"):
        assert by_method[method]["acceptance_length"] == before[method]["acceptance_length"]
        assert by_method[method]["accept_rate_by_position"] == before[method]["accept_rate_by_position"]


class _ShortPromptOracle(OracleProposer):
    """Right on prompts of at most `limit` tokens, wrong beyond: acceptance must split by band."""

    def __init__(self, continuations, limit: int) -> None:
        super().__init__(continuations, name="eagle3")
        self.limit = limit

    def propose(self, tokens, new_aux, k):
        cont, done = self._reference(tokens)
        drafts = cont[done : done + k]
        return drafts if len(tokens) - done <= self.limit else [(t + 1) % VOCAB for t in drafts]


def test_acceptance_is_reported_per_prompt_length_band_with_the_training_band_marked(target, prompts, greedy):
    sets = {"a": [(f"p{i}", p) for i, p in enumerate(prompts)]}  # 5, 9 and 14 tokens
    bands = LengthBands(edges=(8, 12), training_length=8)
    rows = run_inprocess_benchmark(
        target, sets, {"eagle3": _ShortPromptOracle(greedy, 8)}, [SpecConfig(3)], 1 + 3 * 4, rounds=1, bands=bands
    )
    eagle = next(r for r in rows if r["method"] == "eagle3")
    got = [(b["band"], b["training_band"], b["num_prompts"], b["acceptance_length"]) for b in eagle["bands"]]
    assert got == [("1–8", True, 1, 4.0), ("9–12", False, 1, 1.0), ("> 12", False, 1, 1.0)]
    assert 1.0 < eagle["acceptance_length"] < 4.0


def test_a_speculative_output_that_differs_is_reported_with_prompt_and_position():
    with pytest.raises(OutputMismatchError, match=r"eagle3 3,1,4 on prompt 'set/p7'.*token 2"):
        check_identical("eagle3 3,1,4", "set/p7", [4, 5, 6, 7], [4, 5, 9, 7])


def test_untrained_drafter_on_the_micro_target_reproduces_greedy_output(micro_target, micro_profile):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3_dagster.bench.prompts import heldout_sharegpt, render_prompts
    from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter

    model = AutoModelForCausalLM.from_pretrained(micro_target).eval()
    tokenizer = AutoTokenizer.from_pretrained(micro_target)
    prompt_set = heldout_sharegpt(3, micro_profile.data.heldout_fraction)
    prompts = render_prompts(tokenizer, prompt_set, max_prompt_tokens=96)
    assert prompts and all(ids for _, ids in prompts)
    tc = model.config
    cfg = DrafterConfig.for_target(
        target_hidden_size=tc.hidden_size,
        target_intermediate_size=tc.intermediate_size,
        vocab_size=tc.vocab_size,
        draft_vocab_size=128,
        aux_layers=micro_profile.hidden.aux_layers,
        num_attention_heads=2,
    )
    t2d = torch.zeros(tc.vocab_size, dtype=torch.bool)
    t2d[torch.randperm(tc.vocab_size, generator=torch.Generator().manual_seed(0))[:128]] = True
    hot = t2d.nonzero().squeeze(-1)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, model.get_input_embeddings().weight.detach(), hot - torch.arange(128), t2d)
    proposers = {"eagle3_untrained": Eagle3Proposer(drafter, name="eagle3_untrained"), "ngram": NgramProposer()}
    rows = run_inprocess_benchmark(
        model,
        {"heldout_sharegpt": prompts},
        proposers,
        [SpecConfig(3), SpecConfig(7)],
        max_new_tokens=micro_profile.bench.max_new_tokens,
        check=True,
        rounds=1,
    )
    assert [(r["method"], r["spec"]) for r in rows] == [
        ("no_spec", None),
        ("eagle3_untrained", "3,1,4"),
        ("eagle3_untrained", "7,1,8"),
        ("ngram", "3,1,4"),
        ("ngram", "7,1,8"),
    ]
    assert all(1.0 <= r["acceptance_length"] <= 8.0 for r in rows[1:])


def test_sampled_benchmark_rows_sit_beside_greedy_ones_and_rounds_reproduce_with_the_same_coins(
    target, prompts, greedy
):
    sets = {"a": [(f"p{i}", p) for i, p in enumerate(prompts)]}
    proposers = {"eagle3": OracleProposer(greedy, name="eagle3"), "ngram": NgramProposer()}
    rows = run_inprocess_benchmark(
        target,
        sets,
        proposers,
        [SpecConfig(3)],
        MAX_NEW,
        rounds=2,
        temperatures=(0.0, 1.0),
        sampled_proposers={"eagle3"},
    )
    assert [(r["method"], r["temperature"]) for r in rows] == [
        ("no_spec", 0.0),
        ("eagle3", 0.0),
        ("ngram", 0.0),
        ("no_spec", 1.0),
        ("eagle3", 1.0),
    ]
    by = {(r["method"], r["temperature"]): r for r in rows}
    assert by[("eagle3", 0.0)]["acceptance_length"] == 4.0  # the oracle drafts the greedy path
    assert 1.0 <= by[("eagle3", 1.0)]["acceptance_length"] < 4.0  # sampling leaves it
    sampled = by[("eagle3", 1.0)]
    assert sampled["speedup_rounds"] == [
        m / t for m, t in zip(sampled["tokens_per_s_rounds"], by[("no_spec", 1.0)]["tokens_per_s_rounds"])
    ]
    again = run_inprocess_benchmark(
        target, sets, proposers, [SpecConfig(3)], MAX_NEW, rounds=1, temperatures=(1.0,), sampled_proposers={"eagle3"}
    )
    assert [r["completion_tokens"] for r in again] == [
        by[("no_spec", 1.0)]["completion_tokens"],
        sampled["completion_tokens"],
    ]
    assert again[1]["acceptance_length"] == sampled["acceptance_length"]  # seeded coins: the same draws
