"""TTT attention against a naive dense-mask reference, and TTT unrolling against serve-time stepping."""

from __future__ import annotations

import pytest
import torch

from eagle3_dagster.drafter.model import DraftKVCache, DrafterConfig, Eagle3Drafter, repeat_kv
from eagle3_dagster.drafter.ttt import (
    causal_attention_with_lse,
    has_fused_causal,
    ttt_attention,
    ttt_unroll,
)


def naive_ttt_attention(q, k0, v0, extra_k, extra_v):
    """The SpecForge flex mask spelled out: causal over step-0 keys ∪ (kv ≥ T ∧ (kv − q) % T == 0)."""
    t = q.shape[2]
    keys = torch.cat([k0, *extra_k], dim=2)
    values = torch.cat([v0, *extra_v], dim=2)
    q_idx = torch.arange(t)[:, None]
    kv_idx = torch.arange(keys.shape[2])[None, :]
    allowed = ((kv_idx < t) & (kv_idx <= q_idx)) | ((kv_idx >= t) & ((kv_idx - q_idx) % t == 0))
    scores = (q @ keys.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


def _inputs(steps: int, b=2, n=3, t=37, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda: torch.randn(b, n, t, d, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731  (a one-line helper of this test)
    return mk(), mk(), mk(), [mk() for _ in range(steps)], [mk() for _ in range(steps)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused_kernel", "blockwise"])
def test_ttt_attention_matches_dense_mask_reference_forward_and_gradient(fused):
    for steps in (0, 1, 3):
        q, k0, v0, ek, ev = _inputs(steps)
        out = ttt_attention(q, k0, v0, ek, ev, block=8, fused=fused)  # blockwise: several blocks, last one ragged
        ref = naive_ttt_attention(q, k0, v0, ek, ev)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        grad_out = torch.randn_like(out)
        leaves = [q, k0, v0, *ek, *ev]
        got = torch.autograd.grad(out, leaves, grad_out)
        want = torch.autograd.grad(ref, leaves, grad_out)
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_path_matches_reference_in_training_dtypes(device, dtype):
    """The platform kernel (CPU flash, CUDA memory-efficient) in fp32/bf16 against the fp64 reference."""
    q, k0, v0, ek, ev = _inputs(3, t=70, d=16)
    leaves64 = [q, k0, v0, *ek, *ev]
    leaves = [x.detach().to(device, dtype).requires_grad_() for x in leaves64]
    assert has_fused_causal(leaves[0])
    out = ttt_attention(leaves[0], leaves[1], leaves[2], leaves[3:6], leaves[6:], fused=True)
    ref = naive_ttt_attention(q, k0, v0, ek, ev)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double().cpu(), ref, **tol)
    grad_out = torch.randn_like(ref)
    got = torch.autograd.grad(out, leaves, grad_out.to(device, dtype))
    want = torch.autograd.grad(ref, leaves64, grad_out)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_.double().cpu(), w_, **tol)


def test_blockwise_causal_logsumexp_equals_dense_logsumexp():
    q, k, v, _, _ = _inputs(0, t=20)
    _, lse = causal_attention_with_lse(q, k, v, block=6)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(20, 20, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


def _drafter(seed=0, **eagle31) -> tuple[Eagle3Drafter, DrafterConfig]:
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        target_hidden_size=12,
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        vocab_size=40,
        draft_vocab_size=20,
        aux_layers=(1, 2, 3),
        **eagle31,
    )
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[::2] = True
    d2t = torch.arange(0, 40, 2) - torch.arange(20)
    model = Eagle3Drafter(cfg, torch.randn(40, 16), d2t, t2d).double()
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.3)
    return model, cfg


EAGLE31 = [{}, {"fc_norm": True}, {"norm_output": True}, {"fc_norm": True, "norm_output": True}]


@pytest.mark.parametrize("eagle31", EAGLE31, ids=["eagle3", "fc_norm", "norm_output", "eagle3.1"])
def test_ttt_step_j_equals_serve_time_drafting_with_kv_cache(eagle31):
    """Step j at position t is what the drafter computes after prefill up to t and j draft steps."""
    model, _ = _drafter(**eagle31)
    t_len, steps = 11, 3
    ids = torch.randint(0, 40, (1, t_len))
    aux = torch.randn(1, t_len, 36, dtype=torch.float64)
    with torch.no_grad():
        ttt_logits = [model.lm_head(x) for x in ttt_unroll(model, ids, aux, steps, block=4)]
        for t in (0, 4, 6):
            cache = DraftKVCache()
            pos = torch.arange(t + 1)[None]
            hidden, logits = model.step(ids[:, 1 : t + 2], model.project_aux(aux[:, : t + 1]), pos, cache)
            torch.testing.assert_close(logits[:, t], ttt_logits[0][:, t])
            for j in range(1, steps):
                tok = ids[:, t + 1 + j : t + 2 + j]
                hidden, logits = model.step(tok, hidden[:, -1:], torch.tensor([[t + j]]), cache)
                torch.testing.assert_close(logits[:, 0], ttt_logits[j][:, t])
            assert len(cache) == t + steps
            cache.crop(t + 1)
            assert len(cache) == t + 1


@pytest.mark.parametrize("fused", [True, False])
def test_recomputing_the_mlp_in_backward_changes_nothing(fused):
    model, _ = _drafter()
    ids = torch.randint(0, 40, (2, 13))
    aux = torch.randn(2, 13, 36, dtype=torch.float64)
    results = []
    for recompute in (False, True):
        model.zero_grad()
        outs = list(ttt_unroll(model, ids, aux, 3, fused=fused, recompute_mlp=recompute))
        sum((o * (j + 1)).sin().sum() for j, o in enumerate(outs)).backward()
        results.append(
            ([o.detach() for o in outs], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (outs_a, grads_a), (outs_b, grads_b) = results
    for a, b in zip(outs_a, outs_b):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert grads_a.keys() == grads_b.keys() and "midlayer.mlp.down_proj.weight" in grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-12, atol=1e-12)


def reference_unroll(model, ids, aux, num_steps):
    """TTT spelled out with the serve-time layer (`MidLayer.qkv`, per-step ids and RoPE) and a dense mask."""
    b, t = ids.shape
    pos = torch.arange(t).expand(b, t)
    hidden = model.project_aux(aux)
    keys, values = [], []
    for j in range(num_steps):
        step_ids = torch.cat([ids[:, 1 + j :], torch.zeros_like(ids[:, : 1 + j])], 1)  # token t+1+j, 0 past the end
        q, k, v = model.midlayer.qkv(model.embed_tokens(step_ids), hidden, pos + j)
        keys.append(repeat_kv(k, model.cfg.num_attention_heads))
        values.append(repeat_kv(v, model.cfg.num_attention_heads))
        attn = naive_ttt_attention(q, keys[0], values[0], keys[1:], values[1:])
        hidden = model.midlayer.finish(attn, hidden)
        yield model.norm(hidden)


@pytest.mark.parametrize("fused", [True, False])
def test_ttt_unroll_equals_the_step_by_step_reference_in_outputs_and_gradients(fused):
    """The unroll precomputes the embedding half of q/k/v for every step and one RoPE table: nothing changes."""
    model, _ = _drafter()
    ids = torch.randint(0, 40, (2, 13))
    ids[:, -1] = 7  # a real token id at the end: the pad (id 0) is not the last token's neighbour by accident
    aux = torch.randn(2, 13, 36, dtype=torch.float64)
    results = []
    for unroll in (reference_unroll, lambda *a: ttt_unroll(*a, fused=fused)):
        model.zero_grad()
        outs = list(unroll(model, ids, aux, 4))
        sum((o * (j + 1)).sin().sum() for j, o in enumerate(outs)).backward()
        results.append(
            ([o.detach() for o in outs], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (want_outs, want_grads), (got_outs, got_grads) = results
    for got, want in zip(got_outs, want_outs):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert got_grads.keys() == want_grads.keys() and "midlayer.input_layernorm.weight" in got_grads
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-10, atol=1e-10, msg=name)


def _sglang_rmsnorm(x, weight, eps):
    """sglang.srt.layers.layernorm.RMSNorm.forward_native without residual (fp32 inside, cast back, scale)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_eagle31_options_do_what_sglangs_llama_eagle3_does():
    """SGLang 0.5.23 `LlamaModel.forward` (llama_eagle3.py): with `fc_norm` each of the 3 captured states
    (chunks of the concatenation, low to high) gets its own RMSNorm before `fc`; the hidden state the
    next draft step gets is `norm`'s residual sum, or with `norm_output` the normed output."""
    plain, cfg = _drafter(seed=3)
    full, _ = _drafter(seed=3, fc_norm=True, norm_output=True)
    full.load_state_dict(plain.state_dict(), strict=False)
    for i, norm in enumerate(full.fc_norm):
        norm.weight.data.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(i))
    aux = torch.randn(1, 5, 36, dtype=torch.float64) * torch.tensor([1.0, 30.0, 300.0]).repeat_interleave(12)
    chunks = aux.chunk(3, dim=-1)
    want = full.fc(
        torch.cat([_sglang_rmsnorm(c, n.weight, cfg.rms_norm_eps) for c, n in zip(chunks, full.fc_norm)], -1)
    )
    torch.testing.assert_close(full.project_aux(aux), want)
    assert not torch.allclose(plain.project_aux(aux), want)
    ids, pos = torch.randint(0, 40, (1, 5)), torch.arange(5)[None]
    hidden = plain.project_aux(aux)
    with torch.no_grad():
        carried_plain, logits_plain = plain.step(ids, hidden, pos)
        carried_full, logits_full = full.step(ids, hidden, pos)
    torch.testing.assert_close(logits_full, logits_plain)  # the same pass; only what is carried differs
    torch.testing.assert_close(carried_full, _sglang_rmsnorm(carried_plain, plain.norm.weight, cfg.rms_norm_eps))
