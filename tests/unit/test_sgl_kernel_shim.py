"""The CPU shim's kernel ops (tests/sglang_cpu/site/sgl_kernel) against the kernels' own semantics.

`copy_all_layer_kv_cache_cpu`, as sgl-kernel's CPU kernel states it (the CPU counterpart of the Triton
kernel `copy_all_layer_kv_cache_tiled`, which SGLang 0.5.23's `kernels/ops/kvcache/cache_move.py` calls
on CPU): for every buffer b, `buf_b[tgt_loc[i], :] = buf_b[src_loc[i], :]`, rows of `strides[b]` bytes at
the address `data_ptrs[b]`, every source row staged before any target row is written. The reference
below is that statement in torch on the buffers themselves; SGLang's own pools run the op in
tests/real_sglang/test_real_kernels.py.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SHIM = Path(__file__).resolve().parents[1] / "sglang_cpu" / "site" / "sgl_kernel" / "__init__.py"


@pytest.fixture(scope="module")
def shim():
    spec = importlib.util.spec_from_file_location("eagle3_test_sgl_kernel_shim", SHIM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _buffers() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # two layers' K and V of one MHA pool (bf16, 2 heads x 8) and an MLA-like buffer of another row size
    return [torch.randn(12, 2, 8, generator=g).to(torch.bfloat16) for _ in range(4)] + [
        torch.randn(12, 1, 24, generator=g)
    ]


def _pointers(bufs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    return ptrs, strides


def _reference(bufs: list[torch.Tensor], tgt: list[int], src: list[int]) -> list[torch.Tensor]:
    out = [b.clone() for b in bufs]
    for b in out:
        staged = [b[s].clone() for s in src]  # gather every source row first
        for t, row in zip(tgt, staged):
            b[t] = row
    return out


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(
    "tgt,src",
    [
        ([7, 3, 11], [1, 2, 5]),  # disjoint
        ([2, 3, 4, 5], [1, 2, 3, 4]),  # overlapping, shifted up: a row-by-row copy would smear row 1
        ([1, 2, 3], [2, 3, 4]),  # overlapping, shifted down
        ([4, 1], [1, 4]),  # a swap
    ],
)
def test_copy_all_layer_kv_cache_cpu_moves_every_buffers_rows_gathered_before_scattered(shim, index_dtype, tgt, src):
    bufs = _buffers()
    want = _reference(bufs, tgt, src)
    ptrs, strides = _pointers(bufs)
    shim.copy_all_layer_kv_cache_cpu(
        ptrs, strides, torch.tensor(tgt, dtype=index_dtype), torch.tensor(src, dtype=index_dtype)
    )
    for got, ref in zip(bufs, want):
        assert torch.equal(got, ref)  # moved rows and every untouched row, bit for bit


def test_copy_all_layer_kv_cache_cpu_with_nothing_to_move_leaves_the_buffers(shim):
    bufs = _buffers()
    before = [b.clone() for b in bufs]
    ptrs, strides = _pointers(bufs)
    empty = torch.zeros(0, dtype=torch.int64)
    shim.copy_all_layer_kv_cache_cpu(ptrs, strides, empty, empty)
    assert all(torch.equal(a, b) for a, b in zip(bufs, before))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda p, s, t, r: (p.to(torch.int64), s, t, r), "data_ptrs must be uint64"),
        (lambda p, s, t, r: (p, s.to(torch.int32), t, r), "strides must be int64"),
        (lambda p, s, t, r: (p, s, t.to(torch.int32), r), "differ"),
        (lambda p, s, t, r: (p, s, t, r[:1]), "differ in length"),
        (lambda p, s, t, r: (p, s[:1], t, r), "differ in length"),
    ],
)
def test_copy_all_layer_kv_cache_cpu_refuses_what_the_kernel_checks(shim, change, message):
    bufs = _buffers()
    args = change(*_pointers(bufs), torch.tensor([1, 2]), torch.tensor([3, 4]))
    with pytest.raises(RuntimeError, match=message):
        shim.copy_all_layer_kv_cache_cpu(*args)


def test_an_op_the_shim_does_not_implement_names_itself_when_called(shim):
    with pytest.raises(shim.KernelNotAvailable, match="sgl_kernel.fused_moe_router_cpu"):
        shim.fused_moe_router_cpu(torch.zeros(1))


# --- speculative-decoding bookkeeping: what sgl-kernel's CPU kernels compute, stated case by case ------------------


def test_fill_bonus_tokens_takes_each_requests_last_accepted_token(shim):
    accept_tokens = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], dtype=torch.int32)
    bonus = torch.full((3,), -1, dtype=torch.int32)
    shim.fill_bonus_tokens_cpu(accept_tokens.view(-1), torch.tensor([1, 4, 2], dtype=torch.int32), bonus, 4)
    assert bonus.tolist() == [5, 12, 14]


def test_fill_accept_out_cache_loc_compacts_the_accepted_slots_in_order(shim):
    accept_index = torch.tensor([[0, 1, -1, -1], [4, 6, 7, -1]], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 108)
    got = torch.full((8,), -7, dtype=torch.int64)
    shim.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, got)
    assert got.tolist() == [100, 101, 104, 106, 107, -7, -7, -7]


def test_draft_and_extend_cache_locs_are_read_from_each_requests_row(shim):
    req_to_token = torch.arange(60, dtype=torch.int32).view(3, 20)
    rpi, seq_lens = torch.tensor([2, 0]), torch.tensor([5, 11])
    out = torch.empty(2 * 2 * 3, dtype=torch.int64)
    shim.assign_draft_cache_locs_contiguous_cpu(rpi, req_to_token, seq_lens, out, 20, 2, 3)
    assert out.tolist() == [45, 46, 47, 48, 49, 50, 11, 12, 13, 14, 15, 16]
    with pytest.raises(RuntimeError, match="out_cache_loc holds"):
        shim.assign_draft_cache_locs_contiguous_cpu(rpi, req_to_token, seq_lens, out[:-1], 20, 2, 3)
    ext = torch.empty(5, dtype=torch.int64)
    shim.assign_extend_cache_locs_cpu(rpi, req_to_token, torch.tensor([3, 0]), torch.tensor([5, 3]), ext, 20)
    assert ext.tolist() == [43, 44, 0, 1, 2]
    draft = shim.build_draft_decode_metadata_cpu(req_to_token, rpi, seq_lens, 2, 3, 20)
    assert draft.shape == (4, 20) and draft.dtype == torch.int32
    assert draft[1, :8].tolist() == [40, 41, 42, 43, 44, 48, 49, 50]  # request 0, branch 1: prefix + its 3 slots
    assert draft[2, :14].tolist() == list(range(14))  # request 1, branch 0: its row as it is


def test_assign_req_to_token_pool_scatters_the_new_slots_into_each_requests_row_request_after_request(shim):
    """sgl-kernel `assign_req_to_token_pool_cpu` (spec.cpp): `req_to_token[req_pool_indices[i], start[i]:end[i]] =
    out_cache_loc[prefix[i]:prefix[i+1]]`, prefix the running sum of end - start; nothing else is written."""
    req_to_token = torch.full((3, 10), -1, dtype=torch.int32)
    rpi = torch.tensor([2, 0])
    start, end = torch.tensor([4, 0], dtype=torch.int32), torch.tensor([7, 2], dtype=torch.int32)
    shim.assign_req_to_token_pool_cpu(rpi, req_to_token, start, end, torch.tensor([50, 51, 52, 60, 61]), 10)
    want = torch.full((3, 10), -1, dtype=torch.int32)
    want[2, 4:7], want[0, 0:2] = torch.tensor([50, 51, 52]), torch.tensor([60, 61])
    assert torch.equal(req_to_token, want)
    with pytest.raises(RuntimeError, match="out_cache_loc must be int64"):
        shim.assign_req_to_token_pool_cpu(rpi, req_to_token, start, end, torch.tensor([1, 2, 3, 4, 5]).int(), 10)
    with pytest.raises(RuntimeError, match="req_to_token must be int32"):
        shim.assign_req_to_token_pool_cpu(rpi, req_to_token.long(), start, end, torch.tensor([1, 2, 3, 4, 5]), 10)


def _tree(shim, parent_list, selected, seq_lens, topk, depth, n, mode):
    bs = len(seq_lens)
    mask = torch.zeros(bs * n * n if mode == 1 else sum(seq_lens) * n + bs * n * n, dtype=torch.bool)
    positions = torch.zeros(bs * n, dtype=torch.int64)
    index, next_token, next_sibling = torch.full((3, bs, n), -1, dtype=torch.int64)
    shim.build_tree_kernel_efficient_cpu(
        torch.tensor(parent_list),
        torch.tensor(selected),
        torch.tensor(seq_lens),
        mask,
        positions,
        index,
        next_token,
        next_sibling,
        topk,
        depth,
        n,
        mode,
    )
    return mask, positions, index, next_token, next_sibling


def test_a_chain_draft_builds_a_chain_tree_with_a_causal_mask(shim):
    # topk 1, 3 steps: drafts 0, 1, 2 each the child of the one before (parents -1, 0, 1)
    mask, positions, index, nxt, sib = _tree(shim, [[-1, 0, 1]] * 2, [[0, 1, 2]] * 2, [7, 12], 1, 3, 4, 1)
    assert index.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert nxt.tolist() == [[1, 2, 3, -1]] * 2 and sib.tolist() == [[-1] * 4] * 2
    assert positions.tolist() == [7, 8, 9, 10, 12, 13, 14, 15]
    assert torch.equal(mask.view(2, 4, 4), torch.tril(torch.ones(4, 4, dtype=torch.bool)).expand(2, 4, 4))


def test_a_branching_draft_links_children_and_siblings_and_masks_each_branch(shim):
    # topk 2, 2 steps: nodes 1 and 2 are the root's children (first step), node 3 is node 1's child
    mask, positions, index, nxt, sib = _tree(shim, [[-1, 0, 1]], [[0, 1, 2]], [5], 2, 2, 4, 1)
    assert nxt.tolist() == [[1, 3, -1, -1]] and sib.tolist() == [[-1, 2, -1, -1]]
    assert positions.tolist() == [5, 6, 6, 7]
    assert mask.view(4, 4).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    full, *_ = _tree(shim, [[-1, 0, 1]], [[0, 1, 2]], [5], 2, 2, 4, 0)  # FULL_MASK: the 5 committed columns first
    assert full.view(4, 9)[:, :5].all() and torch.equal(full.view(4, 9)[:, 5:], mask.view(4, 4))
    with pytest.raises(shim.KernelNotAvailable, match="bit-packed"):
        _tree(shim, [[-1, 0, 1]], [[0, 1, 2]], [5], 2, 2, 4, 2)


@pytest.mark.parametrize("matching,accepted", [(0, 0), (1, 1), (2, 2), (3, 3)])
def test_greedy_verification_of_a_chain_accepts_the_drafts_up_to_the_first_mismatch(shim, matching, accepted):
    target = torch.tensor([[30, 31, 32, 33]])
    candidates = torch.tensor([[9, 30, 31, 32]])  # drafts after node 0 equal the target's predictions...
    candidates[0, 1 + matching :] += 100  # ...up to `matching`
    predicts = torch.full((4,), -1, dtype=torch.int32)
    accept_index = torch.full((1, 4), -1, dtype=torch.int32)
    num = torch.zeros(1, dtype=torch.int32)
    shim.verify_tree_greedy_cpu(
        predicts,
        accept_index,
        num,
        candidates,
        torch.arange(4)[None],
        torch.tensor([[1, 2, 3, -1]]),
        torch.full((1, 4), -1),
        target,
    )
    assert num.tolist() == [accepted]
    assert accept_index.tolist() == [list(range(accepted + 1)) + [-1] * (3 - accepted)]
    assert predicts.tolist() == [30, 31, 32, 33][: accepted + 1] + [-1] * (3 - accepted)  # each accepted node's target


def test_greedy_verification_of_a_tree_tries_siblings(shim):
    # root's children: node 1 (head) then node 2; node 2's child is node 3. Target after root: 7 (= node 2),
    # after node 2: 8 (= node 3), after node 3: 5.
    candidates = torch.tensor([[0, 6, 7, 8]])
    target = torch.tensor([[7, 0, 8, 5]])
    predicts = torch.full((4,), -1, dtype=torch.int32)
    accept_index = torch.full((1, 3), -1, dtype=torch.int32)
    num = torch.zeros(1, dtype=torch.int32)
    shim.verify_tree_greedy_cpu(
        predicts,
        accept_index,
        num,
        candidates,
        torch.arange(4)[None],
        torch.tensor([[1, -1, 3, -1]]),
        torch.tensor([[-1, 2, -1, -1]]),
        target,
    )
    assert num.tolist() == [2] and accept_index.tolist() == [[0, 2, 3]]
    assert predicts.tolist() == [7, -1, 8, 5]


# --- attention: SGLang's CPU backend's two ops against torch's scaled_dot_product_attention --------------------------


def _paged(seq_lens, heads_kv=2, d=8, dv=8):
    g = torch.Generator().manual_seed(3)
    total = sum(seq_lens) + 5
    k_buffer = torch.randn(total, heads_kv, d, generator=g)
    v_buffer = torch.randn(total, heads_kv, dv, generator=g)
    req_to_token = torch.zeros(len(seq_lens) + 1, 32, dtype=torch.int32)
    perm = torch.randperm(total, generator=g)
    at = 0
    for b, s in enumerate(seq_lens):  # request b lives in row b + 1, its slots scattered over the buffer
        req_to_token[b + 1, :s] = perm[at : at + s].to(torch.int32)
        at += s
    return k_buffer, v_buffer, req_to_token, torch.arange(1, len(seq_lens) + 1)


def _sdpa(q_THD, k_SKD, v_SKD, causal_tail: int | None):
    import torch.nn.functional as F

    mask = None
    if causal_tail is not None:  # the last `causal_tail` keys are the queries' own, causally
        s = k_SKD.shape[0]
        mask = torch.ones(q_THD.shape[0], s, dtype=torch.bool)
        mask[:, s - causal_tail :] = torch.tril(torch.ones(causal_tail, causal_tail, dtype=torch.bool))
    return F.scaled_dot_product_attention(
        q_THD.movedim(0, 1), k_SKD.movedim(0, 1), v_SKD.movedim(0, 1), attn_mask=mask, scale=0.3, enable_gqa=True
    ).movedim(0, 1)


def test_decode_attention_writes_the_new_kv_then_attends_over_each_sequence(shim):
    seq_lens = [6, 3]
    k_buffer, v_buffer, req_to_token, rpi = _paged(seq_lens)
    g = torch.Generator().manual_seed(4)
    q, key, value = (
        torch.randn(2, 4, 8, generator=g),
        torch.randn(2, 2, 8, generator=g),
        torch.randn(2, 2, 8, generator=g),
    )
    loc = torch.stack([req_to_token[1, 5], req_to_token[2, 2]]).long()  # each sequence's last slot: the new token
    out = torch.empty(2, 4, 8)
    torch.ops.sgl_kernel.decode_attention_cpu(
        q,
        k_buffer,
        v_buffer,
        1.0,
        1.0,
        out,
        key,
        value,
        loc,
        torch.empty(2, 4, 8, 9),
        req_to_token,
        rpi,
        torch.tensor(seq_lens),
        0.3,
        0.0,
        False,
        0,
        None,
        None,
    )
    assert torch.equal(k_buffer[loc], key) and torch.equal(v_buffer[loc], value)
    for b, s in enumerate(seq_lens):
        slots = req_to_token[b + 1, :s].long()
        torch.testing.assert_close(out[b : b + 1], _sdpa(q[b : b + 1], k_buffer[slots], v_buffer[slots], None))
    with pytest.raises(shim.KernelNotAvailable, match="sliding windows"):
        torch.ops.sgl_kernel.decode_attention_cpu(
            q,
            k_buffer,
            v_buffer,
            1.0,
            1.0,
            out,
            key,
            value,
            loc,
            torch.empty(2, 4, 8, 9),
            req_to_token,
            rpi,
            torch.tensor(seq_lens),
            0.3,
            0.0,
            False,
            129,
            None,
            None,
        )


def test_extend_attention_sees_the_cached_prefix_and_the_new_tokens_causally(shim):
    seq_lens, extend = [9, 4], [3, 4]  # request 1 has no cached prefix
    k_buffer, v_buffer, req_to_token, rpi = _paged(seq_lens)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(7, 4, 8, generator=g)
    k_new, v_new = torch.randn(7, 2, 8, generator=g), torch.randn(7, 2, 8, generator=g)
    out = torch.empty(7, 4, 8)
    torch.ops.sgl_kernel.extend_attention_cpu(
        q,
        k_new,
        v_new,
        out,
        k_buffer,
        v_buffer,
        1.0,
        1.0,
        req_to_token,
        rpi,
        torch.tensor(seq_lens),
        torch.tensor(extend),
        torch.tensor([0, 3]),
        4,
        0.3,
        0.0,
        False,
        0,
        None,
        None,
        None,
        True,
    )
    prefix = req_to_token[1, :6].long()
    torch.testing.assert_close(
        out[:3], _sdpa(q[:3], torch.cat([k_buffer[prefix], k_new[:3]]), torch.cat([v_buffer[prefix], v_new[:3]]), 3)
    )
    torch.testing.assert_close(out[3:], _sdpa(q[3:], k_new[3:], v_new[3:], 4))
    with pytest.raises(shim.KernelNotAvailable, match="tree masks"):
        torch.ops.sgl_kernel.extend_attention_cpu(
            q,
            k_new,
            v_new,
            out,
            k_buffer,
            v_buffer,
            1.0,
            1.0,
            req_to_token,
            rpi,
            torch.tensor(seq_lens),
            torch.tensor(extend),
            torch.tensor([0, 3]),
            4,
            0.3,
            0.0,
            False,
            0,
            None,
            None,
            torch.ones(32, dtype=torch.bool),
            True,
        )


def test_extend_attention_with_new_kv_of_other_heads_than_the_cache_skips_the_prefix_as_the_kernel_does(shim):
    """sgl-kernel's `extend_attention_cpu`: `is_prefix_skipped = k_buffer.size(1) != num_heads_kv` (DeepSeek's MHA
    prefill, whose K/V [T, H, 192]/[T, H, 128] are not the latent cache's [N, 1, 576] rows): the cache is never
    read, the new tokens attend causally to their own K/V only, and a cached prefix is refused."""
    heads, d, dv = 4, 32, 16
    seq_lens = [5, 3]
    g = torch.Generator().manual_seed(6)
    latent = torch.randn(16, 1, 48, generator=g)  # an MLA cache: one head, another width
    req_to_token = torch.zeros(3, 32, dtype=torch.int32)
    req_to_token[1, :5], req_to_token[2, :3] = torch.arange(5), torch.arange(5, 8)
    q = torch.randn(8, heads, d, generator=g)
    k_new, v_new = torch.randn(8, heads, d, generator=g), torch.randn(8, heads, dv, generator=g)
    out = torch.empty(8, heads, dv)
    args = (latent, latent[..., :dv], 1.0, 1.0, req_to_token, torch.tensor([1, 2]))
    torch.ops.sgl_kernel.extend_attention_cpu(
        q,
        k_new,
        v_new,
        out,
        *args,
        torch.tensor(seq_lens),
        torch.tensor(seq_lens),
        torch.tensor([0, 5]),
        5,
        0.3,
        0.0,
        False,
        0,
        None,
        None,
        None,
        True,
    )
    torch.testing.assert_close(out[:5], _sdpa(q[:5], k_new[:5], v_new[:5], 5))
    torch.testing.assert_close(out[5:], _sdpa(q[5:], k_new[5:], v_new[5:], 3))
    with pytest.raises(RuntimeError, match="expect seq_len_prefix to be 0, got 2"):
        torch.ops.sgl_kernel.extend_attention_cpu(
            q[:3],
            k_new[:3],
            v_new[:3],
            out[:3],
            *args[:5],
            torch.tensor([1]),
            torch.tensor([5]),
            torch.tensor([3]),
            torch.tensor([0]),
            3,
            0.3,
            0.0,
            False,
            0,
            None,
            None,
            None,
            True,
        )


def test_kvcacheio_names_are_placeholders_that_name_themselves_when_called():
    # SGLang <= 0.5.12 imports HiCache's host-transfer ops at module level on CPU (memory_pool_host.py); in a
    # process of its own: importing the shim as `sgl_kernel` registers its torch ops
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from sgl_kernel.kvcacheio import transfer_kv_per_layer as op\n"
        "try:\n    op()\nexcept NotImplementedError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(SHIM.parents[1])], capture_output=True, text=True, check=True)
    assert "sgl_kernel.kvcacheio.transfer_kv_per_layer was called" in out.stdout
