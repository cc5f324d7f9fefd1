"""The CPU shim's ops under SGLang's own callers (0.5.23, in the tier's venv), against SGLang's own torch path.

`copy_all_layer_kv_cache_cpu`: SGLang's `MHATokenToKVPool` built for speculative decoding
(`enable_kv_cache_copy=True`: its constructor calls the op once) moves KV rows through
`kernels/ops/kvcache/cache_move.copy_all_layer_kv_cache_func`, which on CPU hands them to the op
(in chunks of at most 256 rows); `move_kv_cache_native` is SGLang's own torch implementation of the same
move (what `SGLANG_NATIVE_MOVE_KV_CACHE=1` selects). Both must leave every buffer bit for bit alike,
for rows that overlap and for more rows than one chunk.
"""

from __future__ import annotations

import os
import subprocess

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
]  # SGLang's own release code on CPU, in a venv built from PyPI (tests/sglang_cpu)

SCRIPT = r"""
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, move_kv_cache_native

pool = MHATokenToKVPool(size=1024, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=8, v_head_dim=4,
                        layer_num=3, device="cpu", enable_memory_saver=False, enable_kv_cache_copy=True)
assert pool._kv_copy_config is not None, "the pool did not set up the kernel copy"
g = torch.Generator().manual_seed(0)
for buf in [*pool.k_buffer, *pool.v_buffer]:
    buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
cases = {
    "overlapping shift": (torch.arange(10, 40), torch.arange(5, 35)),
    "swap": (torch.tensor([3, 900]), torch.tensor([900, 3])),
    # disjoint sets: SGLang moves more than 256 rows chunk by chunk, so a chunk's targets must not be a later
    # chunk's sources (with overlapping random sets its chunked move and the one-shot native one differ)
    "more rows than one chunk": (torch.randperm(300, generator=g) + 600, torch.randperm(300, generator=g) + 1),
}
for name, (tgt, src) in cases.items():
    k_ref = [b.clone() for b in pool.k_buffer]
    v_ref = [b.clone() for b in pool.v_buffer]
    move_kv_cache_native(k_ref, v_ref, tgt, src)
    pool.move_kv_cache(tgt, src)
    same = all(torch.equal(a, b) for a, b in zip([*pool.k_buffer, *pool.v_buffer], [*k_ref, *v_ref]))
    print(name, "equal" if same else "DIFFERENT")
"""


def test_sglangs_kv_pool_moves_rows_through_the_shim_op_exactly_as_its_native_torch_move(sglang_python):
    proc = subprocess.run(
        [str(sglang_python), "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:3] == ["overlapping shift equal", "swap equal", "more rows than one chunk equal"], (
        proc.stdout + proc.stderr[-2000:]
    )
