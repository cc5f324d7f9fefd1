"""The MLA drafter layer against a plain forward written from DeepSeek's formulas, forward and gradient.

The reference below is spelled out from DeepSeek-V3's reference inference code (`inference/model.py`: complex
rotary on interleaved pairs, yarn frequencies, softmax scale x mscale²) and SGLang 0.5.23's
`Eagle3MLADecoderLayer` (the 2H input cat(input_layernorm(embeds), hidden_norm(hidden)) feeding q_a_proj and
kv_a_proj_with_mqa; residual from the un-normed hidden): dense matrices, an explicit mask, nothing shared with
`drafter/mla.py` but the weights. Training-time test over it must equal that forward step by step: step 0 is the
plain forward; step j attends causally to the step-0 keys plus the same-position key of steps 1..j, at RoPE
position t+j, with EAGLE 3.1's fc_norm / norm_output as in the GQA drafter.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eagle3_dagster.drafter.model import DraftKVCache, DrafterConfig, Eagle3Drafter
from eagle3_dagster.drafter.ttt import ttt_unroll

V, H, T_H, DV = 40, 16, 12, 20
# Kimi-K2.5's yarn shape (factor, beta, mscale 1 / mscale_all_dim 1) at a context the test reaches: positions past
# original_max_position_embeddings use the interpolated frequencies, and the softmax scale carries mscale².
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def mla_drafter(seed=0, rope_scaling=YARN, v_head_dim=6, **eagle31) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        target_hidden_size=T_H,
        hidden_size=H,
        intermediate_size=24,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=4 + 6,
        vocab_size=V,
        draft_vocab_size=DV,
        aux_layers=(1, 2, 3),
        attention="mla",
        q_lora_rank=10,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=6,
        v_head_dim=v_head_dim,
        rope_theta=50.0,
        rope_scaling=rope_scaling,
        **eagle31,
    )
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[::2] = True
    model = Eagle3Drafter(cfg, torch.randn(V, H), torch.arange(0, V, 2) - torch.arange(DV), t2d).double()
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, mean=1.0 if name.endswith("norm.weight") or ".fc_norm." in name else 0.0, std=0.3)
    return model


# ---- the reference: DeepSeek-V3 inference/model.py's MLA, written out -----------------------------------------


def ref_freqs_cis(cfg: DrafterConfig, seqlen: int) -> torch.Tensor:
    """precompute_freqs_cis: yarn-corrected frequencies, as complex rotations e^{i·t·f} [seqlen, rope/2]."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if cfg.rope_scaling is not None:
        r = cfg.rope_scaling

        def correction_dim(num_rotations):
            return (
                dim
                * math.log(r["original_max_position_embeddings"] / (num_rotations * 2 * math.pi))
                / (2 * math.log(base))
            )

        low = max(math.floor(correction_dim(r["beta_fast"])), 0)
        high = min(math.ceil(correction_dim(r["beta_slow"])), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low + (low == high) * 0.001)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / r["factor"] * (1 - smooth) + freqs * smooth
    return torch.polar(
        torch.ones(seqlen, dim // 2, dtype=torch.float64), torch.outer(torch.arange(seqlen, dtype=torch.float64), freqs)
    )


def ref_rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """apply_rotary_emb: pairs (2i, 2i+1) as complex numbers times the rotation. x [B,T,N,D], freqs [B,T,D/2]."""
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * freqs_cis[:, :, None]).flatten(-2)


def ref_softmax_scale(cfg: DrafterConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling is not None:
        m = 0.1 * cfg.rope_scaling["mscale_all_dim"] * math.log(cfg.rope_scaling["factor"]) + 1.0
        scale *= m * m
    return scale


def rms(x, w, eps):
    """SGLang's RMSNorm.forward_native: normalised in fp32, cast back, scaled."""
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ref_qkv(model: Eagle3Drafter, embeds, hidden, pos, freqs):
    """q, k [B,N,T,nope+rope] and v [B,N,T,v] of one layer input, from the weights by name."""
    c, p = model.cfg, dict(model.named_parameters())
    at = "midlayer.self_attn."
    b, t, _ = hidden.shape
    x = torch.cat(
        [
            rms(embeds, p["midlayer.input_layernorm.weight"], c.rms_norm_eps),
            rms(hidden, p["midlayer.hidden_norm.weight"], c.rms_norm_eps),
        ],
        -1,
    )
    q_a = rms(x @ p[at + "q_a_proj.weight"].T, p[at + "q_a_layernorm.weight"], c.rms_norm_eps)
    q = q_a @ p[at + "q_b_proj.weight"].T
    q = q.view(b, t, c.num_attention_heads, -1)
    q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
    kv = x @ p[at + "kv_a_proj_with_mqa.weight"].T
    latent, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
    kv = rms(latent, p[at + "kv_a_layernorm.weight"], c.rms_norm_eps) @ p[at + "kv_b_proj.weight"].T
    k_nope, v = kv.view(b, t, c.num_attention_heads, -1).split([c.qk_nope_head_dim, c.v_head_dim], -1)
    f = freqs[pos]
    q = torch.cat([q_nope, ref_rotary(q_pe, f)], -1)
    k = torch.cat([k_nope, ref_rotary(k_pe[:, :, None], f).expand(-1, -1, c.num_attention_heads, -1)], -1)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def ref_rest(model: Eagle3Drafter, attn_BNTV, hidden):
    p = dict(model.named_parameters())
    b, _, t, _ = attn_BNTV.shape
    h = hidden + attn_BNTV.transpose(1, 2).reshape(b, t, -1) @ p["midlayer.self_attn.o_proj.weight"].T
    x = rms(h, p["midlayer.post_attention_layernorm.weight"], model.cfg.rms_norm_eps)
    out = (
        h
        + (F.silu(x @ p["midlayer.mlp.gate_proj.weight"].T) * (x @ p["midlayer.mlp.up_proj.weight"].T))
        @ p["midlayer.mlp.down_proj.weight"].T
    )
    normed = rms(out, p["norm.weight"], model.cfg.rms_norm_eps)
    return (normed if model.cfg.norm_output else out), normed


def ref_fc(model: Eagle3Drafter, aux):
    p = dict(model.named_parameters())
    if model.cfg.fc_norm:
        chunks = aux.chunk(3, -1)
        aux = torch.cat([rms(c, p[f"fc_norm.{i}.weight"], model.cfg.rms_norm_eps) for i, c in enumerate(chunks)], -1)
    return aux @ p["fc.weight"].T


def reference_unroll(model: Eagle3Drafter, ids, aux, num_steps):
    """TTT with dense scores: step j's query t sees step-0 keys 0..t and the key at t of every step 1..j."""
    b, t = ids.shape
    freqs = ref_freqs_cis(model.cfg, t + num_steps)
    pos = torch.arange(t).expand(b, t)
    hidden = ref_fc(model, aux)
    scale = ref_softmax_scale(model.cfg)
    keys, values = [], []
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for j in range(num_steps):
        step_ids = torch.cat([ids[:, 1 + j :], torch.zeros_like(ids[:, : 1 + j])], 1)
        q, k, v = ref_qkv(model, model.embed_tokens(step_ids), hidden, pos + j, freqs)
        keys.append(k)
        values.append(v)
        scores = [(q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [(q * kj).sum(-1, keepdim=True) * scale for kj in keys[1:]]
        probs = torch.softmax(torch.cat(scores, -1), -1)
        attn = probs[..., :t] @ values[0] + sum(probs[..., t + i : t + i + 1] * vj for i, vj in enumerate(values[1:]))
        hidden, normed = ref_rest(model, attn, hidden)
        yield normed


# ---- the tests ---------------------------------------------------------------------------------------------------


def _outputs_and_grads(model, unroll, ids, aux, steps):
    model.zero_grad()
    outs = list(unroll(model, ids, aux, steps))
    sum((o * (j + 1)).sin().sum() for j, o in enumerate(outs)).backward()
    return [o.detach() for o in outs], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# The model is float64 but builds its RoPE tables in fp32 (as SGLang's cos/sin cache) and normalises in fp32 (as
# SGLang's RMSNorm): the float64 reference agrees to ~1e-6 of each tensor's scale. A wrong pairing, scale or yarn
# term is off by 1e-2 and more (see the yarn guard).
CLOSE = {"rtol": 2e-6, "atol": 2e-6}


def assert_grad_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-5 * max(scale, 1.0), (name, float((got - want).abs().max()), scale)


EAGLE31 = [{}, {"fc_norm": True}, {"norm_output": True}, {"fc_norm": True, "norm_output": True}]
EAGLE31_IDS = ["eagle3", "fc_norm", "norm_output", "eagle3.1"]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "blockwise"])
@pytest.mark.parametrize("eagle31", EAGLE31, ids=EAGLE31_IDS)
def test_mla_ttt_unroll_equals_the_plain_forward_in_outputs_and_gradients(fused, eagle31):
    model = mla_drafter(**eagle31)
    ids = torch.randint(0, V, (2, 13))
    aux = torch.randn(2, 13, 3 * T_H, dtype=torch.float64)
    want_outs, want_grads = _outputs_and_grads(model, reference_unroll, ids, aux, 4)
    got_outs, got_grads = _outputs_and_grads(model, lambda *a: ttt_unroll(*a, fused=fused, block=4), ids, aux, 4)
    for j, (got, want) in enumerate(zip(got_outs, want_outs, strict=True)):
        torch.testing.assert_close(got, want, **CLOSE, msg=f"step {j}")
    params = {n for n, p in model.named_parameters() if p.requires_grad} - {"lm_head.weight"}  # applied by the loss
    assert got_grads.keys() == want_grads.keys() == params  # every MLA weight is trained
    for name in want_grads:
        assert_grad_close(got_grads[name], want_grads[name], name)


@pytest.mark.parametrize("v_head_dim", [6, 10, 14], ids=["v<qk", "v=qk", "v>qk"])
@pytest.mark.parametrize("rope_scaling", [YARN, None], ids=["yarn", "plain"])
def test_one_unrolled_step_is_the_plain_forward_whatever_the_head_sizes_and_rope(v_head_dim, rope_scaling):
    """The fused kernel wants one head size: values narrower or wider than the queries are padded around it."""
    model = mla_drafter(seed=1, rope_scaling=rope_scaling, v_head_dim=v_head_dim)
    ids = torch.randint(0, V, (1, 17))
    aux = torch.randn(1, 17, 3 * T_H, dtype=torch.float64)
    want_outs, want_grads = _outputs_and_grads(model, reference_unroll, ids, aux, 2)
    got_outs, got_grads = _outputs_and_grads(model, lambda *a: ttt_unroll(*a, fused=True), ids, aux, 2)
    for got, want in zip(got_outs, want_outs, strict=True):
        torch.testing.assert_close(got, want, **CLOSE)
    for name in want_grads:
        assert_grad_close(got_grads[name], want_grads[name], name)


def test_yarn_changes_the_forward_so_the_reference_checks_it():
    """Guard on the test itself: at these positions yarn's frequencies and mscale² differ from plain RoPE."""
    ids = torch.randint(0, V, (1, 17))
    aux = torch.randn(1, 17, 3 * T_H, dtype=torch.float64)
    yarn, plain = mla_drafter(seed=2), mla_drafter(seed=2, rope_scaling=None)
    with torch.no_grad():
        assert not torch.allclose(next(ttt_unroll(yarn, ids, aux, 1)), next(ttt_unroll(plain, ids, aux, 1)))


@pytest.mark.parametrize("eagle31", EAGLE31, ids=EAGLE31_IDS)
def test_mla_serve_time_drafting_with_the_latent_cache_equals_ttt(eagle31):
    """Step j at position t is what `step` computes after prefill up to t and j draft steps, the cache holding
    kv_lora_rank + qk_rope_head_dim values per token."""
    model = mla_drafter(**eagle31)
    t_len, steps = 11, 3
    ids = torch.randint(0, V, (1, t_len))
    aux = torch.randn(1, t_len, 3 * T_H, dtype=torch.float64)
    with torch.no_grad():
        ttt_logits = [model.lm_head(x) for x in ttt_unroll(model, ids, aux, steps)]
        for t in (0, 4, 7):
            cache = DraftKVCache()
            prefill = model.project_aux(aux[:, : t + 1])
            hidden, logits = model.step(ids[:, 1 : t + 2], prefill, torch.arange(t + 1)[None], cache)
            torch.testing.assert_close(logits[:, t], ttt_logits[0][:, t])
            for j in range(1, steps):
                hidden, logits = model.step(
                    ids[:, t + 1 + j : t + 2 + j], hidden[:, -1:], torch.tensor([[t + j]]), cache
                )
                torch.testing.assert_close(logits[:, 0], ttt_logits[j][:, t])
            assert len(cache) == t + steps
            assert cache.values_per_token() == model.cfg.kv_values_per_token() == 8 + 6
            cache.crop(t + 1)
            assert len(cache) == t + 1
