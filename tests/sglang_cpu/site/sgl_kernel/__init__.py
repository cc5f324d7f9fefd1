"""A CPU stand-in for SGLang's kernel package `sgl_kernel` (ours, not SGLang's).

PyPI carries SGLang's kernels (`sglang-kernel`) as CUDA builds only. This package does not
register `torch.ops.sgl_kernel.convert_weight_packed`, so `sglang.srt.utils.cpu_has_amx_support()`
is False and SGLang takes its native-torch CPU paths everywhere it has one. SGLang still imports
some kernel names at module level on CPU (e.g. `from sgl_kernel import copy_all_layer_kv_cache_cpu`
in `kernels/ops/kvcache/cache_move.py`); a name this package does not implement is a placeholder
that raises KernelNotAvailable naming the op when it is called, so a run that needs a kernel says
which one.

What it does implement, in torch, from the semantics of sgl-kernel's CPU kernels (the C++ sources
and their reference tests, and the Triton kernels SGLang's wheel runs on GPUs), is what SGLang's CPU
path of `--speculative-algorithm EAGLE3` calls (tests/sglang_cpu/README.md lists each op and why):
the KV-slot copy, the draft/verify bookkeeping of `kernels/ops/speculative/`, and the two attention
ops of SGLang's CPU attention backend (`intel_amx_backend.py`), the only draft backend SGLang has on
CPU. Each one refuses, naming itself, what it does not implement (fp8 scales, sliding windows,
attention sinks, cross attention, bit-packed tree masks) instead of computing something else.
tests/unit/test_sgl_kernel_shim.py checks them against those semantics, and
tests/real_sglang/test_real_kernels.py under SGLang's own callers.
"""

import ctypes

import torch

__version__ = "0.0.0+cpu-shim"


class KernelNotAvailable(NotImplementedError):
    """An `sgl_kernel` op was called that the CPU shim has no implementation of (or not for these arguments)."""


def _check(ok: bool, op: str, what: str) -> None:
    if not ok:  # TORCH_CHECK in the kernels raises RuntimeError
        raise RuntimeError(f"{op}: {what}")


def _unsupported(op: str, what: str) -> KernelNotAvailable:
    return KernelNotAvailable(
        f"sgl_kernel.{op}: the CPU shim (tests/sglang_cpu/site/sgl_kernel) does not implement {what}"
    )


# --- KV cache -------------------------------------------------------------------------------------


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer b: `buf_b[tgt_loc[i], :] = buf_b[src_loc[i], :]` for every i, in place.

    `data_ptrs` [B] uint64: the base address of each K/V buffer; `strides` [B] int64: the bytes of one
    slot row of each; `tgt_loc`, `src_loc` [N] of one index dtype (int32 or int64). As in the kernel,
    every source row of a buffer is staged before any target row is written (gather, then scatter), so
    the copy is right however the two index sets overlap.
    """
    op = "copy_all_layer_kv_cache_cpu"
    for name, t in (("data_ptrs", data_ptrs), ("strides", strides), ("tgt_loc", tgt_loc), ("src_loc", src_loc)):
        _check(t.device.type == "cpu" and t.is_contiguous(), op, f"{name} must be a contiguous CPU tensor")
    _check(data_ptrs.dtype == torch.uint64, op, f"data_ptrs must be uint64, got {data_ptrs.dtype}")
    _check(strides.dtype == torch.int64, op, f"strides must be int64, got {strides.dtype}")
    _check(tgt_loc.dtype == src_loc.dtype, op, f"tgt_loc ({tgt_loc.dtype}) and src_loc ({src_loc.dtype}) differ")
    _check(tgt_loc.dtype in (torch.int32, torch.int64), op, f"indices must be int32 or int64, got {tgt_loc.dtype}")
    _check(strides.numel() == data_ptrs.numel(), op, "strides and data_ptrs differ in length")
    _check(src_loc.numel() == tgt_loc.numel(), op, "src_loc and tgt_loc differ in length")
    if data_ptrs.numel() == 0 or tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    rows = int(torch.maximum(tgt.max(), src.max())) + 1  # the rows the copy touches: a view of no more
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buf = torch.frombuffer((ctypes.c_uint8 * (rows * stride)).from_address(ptr), dtype=torch.uint8)
        buf = buf.view(rows, stride)
        staged = buf[src]  # advanced indexing copies: every source row is read before any row is written
        buf[tgt] = staged


# --- speculative decoding bookkeeping (kernels/ops/speculative/ in SGLang's wheel) -----------------


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int
) -> None:
    """`bonus_tokens[i]` = the last accepted token of request i: row i of `accept_tokens` (width
    `accept_stride`) at `accept_lens[i] - 1` (accept_lens counts the bonus)."""
    rows = accept_tokens.reshape(-1, accept_stride)
    n = bonus_tokens.numel()
    bonus_tokens.copy_(rows[torch.arange(n), accept_lens[:n].long() - 1].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor, size: int | None = None
) -> None:
    """Compact the cache slots of the accepted entries: the k-th entry of `accept_index` (flattened, first
    `size`) that is not -1 puts `out_cache_loc[that entry]` at `accept_out_cache_loc[k]`; the rest stays."""
    flat = accept_index.reshape(-1)
    if size is not None:
        flat = flat[:size]
    valid = flat[flat != -1].long()
    accept_out_cache_loc[: valid.numel()] = out_cache_loc[valid].to(accept_out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Request i's `topk * num_steps` draft slots: `req_to_token[req_pool_indices[i], seq_lens[i]:][:topk*num_steps]`,
    at `out_cache_loc[i * topk * num_steps:]`."""
    op = "assign_draft_cache_locs_contiguous_cpu"
    n = topk * num_steps
    _check(req_to_token.dtype == torch.int32, op, f"req_to_token must be int32, got {req_to_token.dtype}")
    _check(
        seq_lens.dtype == torch.int64 and req_pool_indices.dtype == torch.int64,
        op,
        "req_pool_indices and seq_lens must be int64",
    )
    _check(
        out_cache_loc.numel() == seq_lens.numel() * n,
        op,
        f"out_cache_loc holds {out_cache_loc.numel()} slots, expected {seq_lens.numel()} x {n}",
    )
    rows = req_to_token.view(-1, pool_len)
    for i, (r, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * n : (i + 1) * n] = rows[r, s : s + n].to(out_cache_loc.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """`out_cache_loc` = request after request, `req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`."""
    rows = req_to_token.reshape(-1, pool_len)
    at = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        out_cache_loc[at : at + e - s] = rows[r, s:e].to(out_cache_loc.dtype)
        at += e - s


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """The inverse of assign_extend_cache_locs: `req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`
    = the next `end_offset[i] - start_offset[i]` slots of `out_cache_loc`, request after request."""
    op = "assign_req_to_token_pool_cpu"
    _check(req_to_token.dtype == torch.int32, op, f"req_to_token must be int32, got {req_to_token.dtype}")
    _check(out_cache_loc.dtype == torch.int64, op, f"out_cache_loc must be int64, got {out_cache_loc.dtype}")
    _check(start_offset.dtype == end_offset.dtype, op, "start_offset and end_offset must have one dtype")
    rows = req_to_token.view(-1, pool_len)
    at = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        rows[r, s:e] = out_cache_loc[at : at + e - s].to(torch.int32)
        at += e - s


def build_draft_decode_metadata_cpu(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    pool_len: int,
) -> torch.Tensor:
    """A req_to_token row per (request b, branch k) [B * topk, pool_len]: the request's first seq_len slots,
    then branch k's `num_steps` draft slots (`seq_len + k * num_steps` on, the layout
    assign_draft_cache_locs_contiguous gives). Only those first seq_len + num_steps entries are defined."""
    src = req_to_token.view(-1, pool_len)
    out = torch.empty((req_pool_indices.numel() * topk, pool_len), dtype=req_to_token.dtype)
    for b, (r, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        for k in range(topk):
            row = out[b * topk + k]
            row.copy_(src[r])
            row[s : s + num_steps] = src[r, s + k * num_steps : s + (k + 1) * num_steps]
    return out


# TreeMaskMode in SGLang's kernels/ops/speculative/spec_tree.py
_FULL_MASK, _QLEN_ONLY = 0, 1


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """The draft tree of each request: node 0 is the verified last token, node i >= 1 the draft
    `selected_index[i-1]`, whose parent is node 0 when it comes from the first draft step, else the node
    that selected its parent (`parent_list`). Writes each node's flat index (`retrive_index`), first child
    (`retrive_next_token`, the highest-numbered) and next sibling (`retrive_next_sibling`, the next lower),
    its position (verified length + depth) and the tree mask (a node sees itself, its ancestors, node 0,
    and in FULL_MASK every committed token before them)."""
    op = "build_tree_kernel_efficient_cpu"
    if tree_mask_mode not in (_FULL_MASK, _QLEN_ONLY):
        raise _unsupported(op, f"tree mask mode {tree_mask_mode} (bit-packed masks)")
    n = draft_token_num
    prefix_at = 0
    for b in range(selected_index.shape[0]):
        sel, parents = selected_index[b].tolist(), parent_list[b].tolist()
        seq_len = int(verified_seq_len[b])
        parent = [0] * n
        for i in range(1, n):
            step_slot = sel[i - 1] // topk
            parent[i] = 0 if step_slot == 0 else sel.index(parents[step_slot]) + 1
        first_child, next_sibling = [-1] * n, [-1] * n
        for i in range(n - 1, 0, -1):  # children linked from the last node: the head is the highest-numbered
            next_sibling[i] = first_child[parent[i]]
            first_child[parent[i]] = i
        retrive_index[b] = torch.arange(b * n, (b + 1) * n)
        retrive_next_token[b] = torch.tensor(first_child)
        retrive_next_sibling[b] = torch.tensor(next_sibling)
        visible = torch.zeros(n, n, dtype=torch.bool)
        visible[:, 0] = True
        for i in range(n):
            j, d = i, 0
            while j != 0:
                visible[i, j] = True
                j, d = parent[j], d + 1
            positions[b * n + i] = seq_len + d
        if tree_mask_mode == _QLEN_ONLY:
            tree_mask[b * n * n : (b + 1) * n * n] = visible.reshape(-1)
        else:
            rows = tree_mask[prefix_at : prefix_at + n * (seq_len + n)].view(n, seq_len + n)
            rows[:, :seq_len] = True
            rows[:, seq_len:] = visible
            prefix_at += n * (seq_len + n)


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy verification down the draft tree: from the root, take the first child (then its siblings)
    whose draft token equals the target's prediction at the last accepted node, for at most
    `accept_index.shape[1] - 1` levels. Writes the accepted nodes' flat indices (`accept_index`, the root
    first), the number of accepted drafts (`accept_token_num`) and the target's token at every accepted
    node (`predicts`, flat); other entries are left as they are."""
    target = target_predict.reshape(-1)
    num_spec_step = accept_index.shape[1]
    for b in range(candidates.shape[0]):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, num_spec_step):
            node = int(retrive_next_token[b, node])
            while node != -1:
                if int(candidates[b, node]) == int(target[last]):
                    predicts[last] = target[last]
                    accepted += 1
                    last = int(retrive_index[b, node])
                    accept_index[b, accepted] = last
                    break
                node = int(retrive_next_sibling[b, node])
            if node == -1:
                break
        accept_token_num[b] = accepted
        predicts[last] = target[last]


# --- attention (SGLang's CPU attention backend, srt/layers/attention/intel_amx_backend.py) ---------


def _attend(
    q_THD: torch.Tensor,
    k_SKD: torch.Tensor,
    v_SKD: torch.Tensor,
    visible_TS: torch.Tensor | None,
    sm_scale: float,
    logit_cap: float,
) -> torch.Tensor:
    """softmax(q·k * scale [capped]) v in float32, the query heads sharing the key heads in groups (GQA/MQA)."""
    group = q_THD.shape[1] // k_SKD.shape[1]
    k = k_SKD.float().repeat_interleave(group, dim=1)
    v = v_SKD.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q_THD.float(), k) * sm_scale
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if visible_TS is not None:
        scores = scores.masked_fill(~visible_TS, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v)


def _refuse_attention_options(
    op: str, k_scale: float, v_scale: float, is_cross_attn: bool, sliding_window_size: int, sinks
) -> None:
    if k_scale != 1.0 or v_scale != 1.0:
        raise _unsupported(op, f"scaled (fp8) KV caches (k_scale {k_scale}, v_scale {v_scale})")
    if is_cross_attn:
        raise _unsupported(op, "cross attention")
    if sliding_window_size > 0:  # the backend passes layer.sliding_window_size + 1: 0 is no window
        raise _unsupported(op, f"sliding windows ({sliding_window_size - 1})")
    if sinks is not None:
        raise _unsupported(op, "attention sinks")


def _decode_attention_cpu(
    query,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    output,
    key,
    value,
    loc,
    attn_logits,
    req_to_token,
    req_pool_indices,
    seq_lens,
    sm_scale,
    logit_cap,
    is_cross_attn,
    sliding_window_size,
    encoder_lens,
    sinks,
):
    """One new token per sequence: its K/V (when given) written at `loc` first, then attention over the
    sequence's `seq_lens[b]` slots `req_to_token[req_pool_indices[b]]`. `attn_logits` is the kernel's
    split-KV scratch, not an output."""
    _refuse_attention_options("decode_attention_cpu", k_scale, v_scale, is_cross_attn, sliding_window_size, sinks)
    if key is not None and value is not None:
        k_buffer[loc.long()] = key.to(k_buffer.dtype)
        v_buffer[loc.long()] = value.to(v_buffer.dtype)
    for b, (r, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        slots = req_to_token[r, :s].long()
        output[b : b + 1] = _attend(query[b : b + 1], k_buffer[slots], v_buffer[slots], None, sm_scale, logit_cap).to(
            output.dtype
        )


def _extend_attention_cpu(
    q_extend,
    k_extend,
    v_extend,
    o_extend,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_seq_lens,
    extend_start_loc,
    max_len_extend,
    sm_scale,
    logit_cap,
    is_cross_attn,
    sliding_window_size,
    encoder_lens,
    sinks,
    tree_mask=None,
    is_causal=True,
):
    """Sequence b's `extend_seq_lens[b]` new tokens (rows `extend_start_loc[b]` on) attend to its cached
    prefix (the first `seq_lens[b] - extend_seq_lens[b]` slots of `req_to_token[req_pool_indices[b]]`)
    and, causally, to the new tokens' own K/V (`k_extend`/`v_extend`; from the cache when they are None)."""
    op = "extend_attention_cpu"
    _refuse_attention_options(op, k_scale, v_scale, is_cross_attn, sliding_window_size, sinks)
    if tree_mask is not None:  # SGLang passes none for chains (tree_topk 1): causal is the chain's mask
        raise _unsupported(op, "tree masks (speculative verify with topk > 1)")
    # The kernel's MLA case: new K/V with other heads than the cache (DeepSeek's MHA prefill over the latent
    # cache) means "prefix skipped": the cache is not read, and a request with a cached prefix is an error.
    prefix_skipped = k_extend is not None and k_buffer.shape[1] != k_extend.shape[1]
    for b, (r, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        n, at = int(extend_seq_lens[b]), int(extend_start_loc[b])
        _check(not prefix_skipped or s == n, op, f"extend attention: expect seq_len_prefix to be 0, got {s - n}")
        prefix = req_to_token[r, : s - n].long()
        if k_extend is None or v_extend is None:
            own = req_to_token[r, s - n : s].long()
            k_new, v_new = k_buffer[own], v_buffer[own]
        else:
            k_new, v_new = k_extend[at : at + n], v_extend[at : at + n]
        keys, values = k_new, v_new
        if s > n:
            keys = torch.cat([k_buffer[prefix].to(k_new.dtype), k_new])
            values = torch.cat([v_buffer[prefix].to(v_new.dtype), v_new])
        visible = None
        if is_causal:
            visible = torch.ones(n, s, dtype=torch.bool)
            visible[:, s - n :] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        o_extend[at : at + n] = _attend(q_extend[at : at + n], keys, values, visible, sm_scale, logit_cap).to(
            o_extend.dtype
        )


# torch.ops.sgl_kernel.* for the two ops SGLang reaches through torch.ops, with the argument order of the
# 0.5.23 backend's calls; `convert_weight_packed` stays unregistered, so SGLang still sees no AMX kernels.
_LIBRARY = torch.library.Library("sgl_kernel", "DEF")
_LIBRARY.define(
    "decode_attention_cpu(Tensor query, Tensor(a!) k_buffer, Tensor(b!) v_buffer, float k_scale, float v_scale, "
    "Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor(d!) attn_logits, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, "
    "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"
)
_LIBRARY.define(
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, Tensor k_buffer, "
    "Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
    "Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend, float sm_scale, float logit_cap, "
    "bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask=None, "
    "bool is_causal=True) -> ()"
)
_LIBRARY.impl("decode_attention_cpu", _decode_attention_cpu, "CPU")
_LIBRARY.impl("extend_attention_cpu", _extend_attention_cpu, "CPU")


def _missing(name: str):
    def op(*args, **kwargs):
        raise KernelNotAvailable(
            f"sgl_kernel.{name} was called, but the CPU shim (tests/sglang_cpu/site/sgl_kernel) does not implement it"
        )

    op.__name__ = op.__qualname__ = name
    return op


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
