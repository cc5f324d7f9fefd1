"""CUDA's host-copy ordering, emulated on CPU, for code that must be right on a GPU.

What matters for the dump hook, and what a CPU tensor would hide:
- `host.copy_(device_tensor, non_blocking=True)` returns at once; the host bytes change only
  when the stream reaches the copy, which the host learns by waiting on an event recorded
  after it. Here the copy is queued (with the source's value at enqueue time: later kernels
  on the same stream are ordered after it) and lands only in `Event.synchronize()`.
- Pinned memory from `torch.empty(..., pin_memory=True)` is uninitialised: here it is NaN
  (floats) or a sentinel (integers), so reading a buffer before its copy landed shows.
- A synchronous copy or a read of the device tensor itself waits for the stream.

`DeviceTensor` is a CPU tensor that says `is_cuda`; `lagging_cuda(monkeypatch)` installs the
event and the allocator and returns the emulated stream.
"""

from __future__ import annotations

import threading

import torch

_SENTINEL = -(2**31) + 7


class Stream:
    """The pending device-to-host copies, in issue order."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.issued = 0
        self.landed = 0
        self.lock = threading.Lock()
        # Cleared by a test to hold the GPU back: other threads' waits (the dump writer's) block until it is set
        # again, so the test can see copies still in flight when a forward returns, whatever the scheduler does.
        self.gate = threading.Event()
        self.gate.set()

    def enqueue(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            snapshot = src.detach().clone()
        with self.lock:
            self.pending.append((dest, snapshot))
            self.issued += 1

    def run_until(self, mark: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.gate.wait()
        with self.lock:
            while self.landed < mark:
                dest, snapshot = self.pending.pop(0)
                with torch._C.DisableTorchFunctionSubclass():
                    dest.copy_(snapshot)
                self.landed += 1


STREAM: Stream | None = None


class DeviceTensor(torch.Tensor):
    """A tensor on the emulated GPU: host copies from it are asynchronous."""

    @property
    def is_cuda(self) -> bool:
        return True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and len(args) == 2:
            dest, src = args
            if isinstance(src, DeviceTensor) and not isinstance(dest, DeviceTensor):
                if kwargs.get("non_blocking", False):
                    STREAM.enqueue(dest, src)
                    return dest
                STREAM.run_until(STREAM.issued)  # a blocking copy waits for the stream
        return super().__torch_function__(func, types, args, kwargs)


def to_device(t: torch.Tensor) -> DeviceTensor:
    return t.as_subclass(DeviceTensor)


class Event:
    def __init__(self, *args, **kwargs) -> None:
        self.mark: int | None = None

    def record(self, stream=None) -> None:
        self.mark = STREAM.issued

    def synchronize(self) -> None:
        if self.mark is None:
            raise RuntimeError("emulated CUDA: synchronize() on an event that was never recorded")
        STREAM.run_until(self.mark)

    def query(self) -> bool:
        return self.mark is not None and STREAM.landed >= self.mark


def lagging_cuda(monkeypatch) -> Stream:
    """Install the emulation for one test; returns the stream (its `pending` shows copies in flight)."""
    global STREAM
    STREAM = Stream()
    real_empty = torch.empty

    def empty(*size, pin_memory: bool = False, **kwargs):
        t = real_empty(*size, **kwargs)
        if pin_memory:
            t.fill_(float("nan") if t.is_floating_point() else _SENTINEL)
        return t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    return STREAM
