"""The drafter's parameter names, shapes, vocab map and serve-time stepping."""

from __future__ import annotations

import pytest
import torch

from eagle3_dagster.drafter.model import DraftKVCache, DrafterConfig, Eagle3Drafter

CFG = DrafterConfig(
    target_hidden_size=12,
    hidden_size=16,
    intermediate_size=24,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
    vocab_size=40,
    draft_vocab_size=10,
    aux_layers=(2, 3, 5),
)


def _mapping():
    ids = torch.tensor([1, 3, 4, 8, 9, 15, 20, 21, 30, 39])
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(10), t2d


def make_drafter(seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    d2t, t2d = _mapping()
    return Eagle3Drafter(CFG, torch.randn(40, 16), d2t, t2d)


def test_parameter_names_are_the_sglang_names_and_embedding_is_frozen_and_not_exported():
    model = make_drafter()
    names = set(model.trainable_state_dict())
    assert names == {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
    }
    assert not model.embed_tokens.weight.requires_grad
    assert model.midlayer.self_attn.q_proj.weight.shape == (16, 32)  # q/k/v take [embed ; hidden] = 2H
    assert model.midlayer.self_attn.k_proj.weight.shape == (8, 32)
    assert model.fc.weight.shape == (16, 36)


def test_draft_to_target_adds_d2t_offsets():
    model = make_drafter()
    assert model.draft_to_target(torch.tensor([0, 5, 9])).tolist() == [1, 15, 39]


def test_inconsistent_vocab_mapping_is_rejected():
    d2t, t2d = _mapping()
    t2d[2] = True
    t2d[1] = False
    with pytest.raises(ValueError, match="t2d"):
        Eagle3Drafter(CFG, torch.randn(40, 16), d2t, t2d)
    with pytest.raises(ValueError, match="embedding"):
        Eagle3Drafter(CFG, torch.randn(41, 16), *_mapping())


def test_cached_stepping_equals_one_full_causal_pass_and_crop_rolls_back():
    model = make_drafter().eval()
    ids = torch.randint(0, 40, (2, 9))
    hidden = torch.randn(2, 9, 16)
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        full_h, full_logits = model.step(ids, hidden, pos)
        cache = DraftKVCache()
        h_a, _ = model.step(ids[:, :5], hidden[:, :5], pos[:, :5], cache)
        h_b, logits_b = model.step(ids[:, 5:], hidden[:, 5:], pos[:, 5:], cache)
        assert len(cache) == 9
        torch.testing.assert_close(torch.cat([h_a, h_b], 1), full_h)
        torch.testing.assert_close(logits_b, full_logits[:, 5:])
        cache.crop(6)
        h_c, _ = model.step(ids[:, 6:7], hidden[:, 6:7], pos[:, 6:7], cache)
        torch.testing.assert_close(h_c[:, 0], full_h[:, 6])
    assert full_logits.shape == (2, 9, 10)
    with pytest.raises(ValueError):
        cache.crop(100)


def test_config_defaults_follow_public_deepseek_v3_drafters():
    cfg = DrafterConfig.for_target(
        target_hidden_size=7168,
        target_intermediate_size=18432,
        vocab_size=163840,
        draft_vocab_size=32000,
        aux_layers=[2, 30, 58],
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (56, 8, 128)
    assert cfg.hidden_size == 7168 and cfg.intermediate_size == 18432
