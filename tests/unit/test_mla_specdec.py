"""The in-process simulator drafts with an MLA drafter's latent KV cache, and that cache changes nothing: every draft
equals what recomputing the drafter over the whole sequence without a cache gives, token for token."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from eagle3_dagster.bench.proposers import Eagle3Proposer
from eagle3_dagster.bench.specdec import SpecConfig, TargetRunner, generate_greedy, generate_speculative
from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
from tests.tiny_deepseek import HIDDEN, VOCAB, decoding_target

AUX = (1, 2, 3)
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


@pytest.fixture(scope="module")
def target() -> DeepseekV3ForCausalLM:
    return decoding_target()


def mla_drafter(target, seed=3) -> Eagle3Drafter:
    cfg = DrafterConfig(
        target_hidden_size=HIDDEN,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=12,
        vocab_size=VOCAB,
        draft_vocab_size=48,
        aux_layers=AUX,
        attention="mla",
        q_lora_rank=12,
        kv_lora_rank=10,
        qk_nope_head_dim=6,
        qk_rope_head_dim=6,
        v_head_dim=8,
        rope_scaling=YARN,
    )
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:48]] = True
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(
        cfg, target.get_input_embeddings().weight.detach(), t2d.nonzero().squeeze(-1) - torch.arange(48), t2d
    )
    for name, p in drafter.named_parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.3)
    return drafter.eval()


class UncachedProposer:
    """The same drafting, recomputed from position 0 at every draft step without any cache: the inputs are the
    verified tokens with their target aux states, then the drafts with the drafter's own carried outputs."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter, self.name, self.aux_layers = drafter, "uncached", AUX
        self.aux: torch.Tensor | None = None

    def reset(self) -> None:
        self.aux = None

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], new_aux_1T3H: torch.Tensor, k: int) -> list[int]:
        n = len(tokens)
        start = n - 1 - new_aux_1T3H.shape[1]
        self.aux = new_aux_1T3H if self.aux is None else torch.cat([self.aux[:, :start], new_aux_1T3H], dim=1)
        ids, hidden = list(tokens[1:]), self.drafter.project_aux(self.aux)
        drafts = []
        for _ in range(k):
            out, logits = self.drafter.step(torch.tensor([ids]), hidden, torch.arange(len(ids))[None], cache=None)
            draft = int(self.drafter.draft_to_target(logits[:, -1].argmax(-1)))
            drafts.append(draft)
            ids.append(draft)
            hidden = torch.cat([hidden, out[:, -1:]], dim=1)
        return drafts


class BothProposer:
    """Drafts with the cached proposer and asserts, at every call, that the uncached one drafts the same."""

    def __init__(self, cached: Eagle3Proposer, uncached: UncachedProposer) -> None:
        self.cached, self.uncached, self.name, self.aux_layers = cached, uncached, "both", AUX
        self.calls, self.extends = 0, set()

    def reset(self) -> None:
        self.cached.reset()
        self.uncached.reset()

    def propose(self, tokens, new_aux_1T3H, k):
        got, want = self.cached.propose(tokens, new_aux_1T3H, k), self.uncached.propose(tokens, new_aux_1T3H, k)
        assert got == want, (self.calls, got, want)
        self.calls += 1
        self.extends.add(new_aux_1T3H.shape[1])
        return got


def test_the_mla_cache_holds_the_latent_and_the_rotated_shared_key_per_token(target):
    drafter = mla_drafter(target)
    proposer = Eagle3Proposer(drafter)
    runner = TargetRunner(target, AUX)
    runner.reset()
    prompt = list(range(5, 17))
    _, aux = runner.forward(prompt)
    proposer.propose(prompt + [7], aux, 3)
    latent, k_rope = proposer.cache.parts
    assert tuple(latent.shape) == (1, 1, len(prompt) + 2, 10) and tuple(k_rope.shape) == (1, 1, len(prompt) + 2, 6)
    assert proposer.cache.values_per_token() == drafter.cfg.kv_values_per_token() == 10 + 6  # not 2 x 4 x 12


def test_cached_mla_drafting_equals_uncached_recomputation_token_for_token_in_the_simulator(target):
    """Greedy speculative decoding at 3,1,4 and 7,1,8 on prompts past yarn's original context: every proposal of
    the cached drafter (rolled back after each rejection, extended by every verified position) is the uncached
    one, and the output is the target's greedy output."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 12, 20)]
    runner = TargetRunner(target, AUX)
    drafter = mla_drafter(target)
    for spec in (SpecConfig(3), SpecConfig(7)):
        both = BothProposer(Eagle3Proposer(drafter), UncachedProposer(drafter))
        for prompt in prompts:
            gen = generate_speculative(runner, both, prompt, spec, max_new_tokens=24)
            assert gen.output_ids == generate_greedy(TargetRunner(target), prompt, 24).output_ids
        assert both.calls > 10


def test_cached_and_uncached_drafting_agree_over_extends_of_every_length(target):
    """The engine extends by 1 + accepted drafts: replay commits of 1 to 5 tokens (the cache crops its own draft
    positions each time) and compare every proposal."""
    drafter = mla_drafter(target, seed=5)
    runner = TargetRunner(target, AUX)
    runner.reset()
    both = BothProposer(Eagle3Proposer(drafter), UncachedProposer(drafter))
    both.reset()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, VOCAB, (9,), generator=g).tolist()
    _, aux = runner.forward(tokens)
    tokens.append(11)
    for commit in (1, 3, 5, 2, 4, 1, 1, 5):
        both.propose(tokens, aux, 4)
        new = torch.randint(3, VOCAB, (commit,), generator=g).tolist()
        _, aux = runner.forward([tokens[-1], *new[:-1]])  # the verified positions' aux states
        tokens += new
    assert both.extends == {1, 2, 3, 4, 5, 9}
