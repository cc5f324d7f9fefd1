"""A CPU stand-in for SGLang's kernel package `sgl_kernel` (ours, not SGLang's).

PyPI carries SGLang's kernels (`sglang-kernel`) as CUDA builds only. This package
registers no torch op, so `torch.ops.sgl_kernel.convert_weight_packed` does not exist,
`sglang.srt.utils.cpu_has_amx_support()` is False and SGLang takes its native-torch
CPU paths. SGLang still imports some kernel names at module level on CPU (e.g.
`from sgl_kernel import copy_all_layer_kv_cache_cpu` in `kernels/ops/kvcache/cache_move.py`);
each such name is a placeholder that raises NotImplementedError naming the op when it
is called, so a run that needs a kernel says which one.
"""

__version__ = "0.0.0+cpu-shim"


class KernelNotAvailable(NotImplementedError):
    """An `sgl_kernel` op was called; the CPU shim has no implementation of it."""


def _missing(name: str):
    def op(*args, **kwargs):
        raise KernelNotAvailable(
            f"sgl_kernel.{name} was called, but the CPU shim (tests/sglang_cpu/sgl_kernel) does not implement it"
        )

    op.__name__ = op.__qualname__ = name
    return op


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
