"""`sgl_kernel.kvcacheio` of the CPU shim (ours): SGLang <= 0.5.12 imports its HiCache host-transfer ops at module
level on CPU (`sglang/srt/mem_cache/memory_pool_host.py:47`, reached from the scheduler at start-up). The tier runs
without HiCache, so every name is a placeholder that raises KernelNotAvailable naming the op when it is called."""

from sgl_kernel import _missing


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(f"kvcacheio.{name}")
