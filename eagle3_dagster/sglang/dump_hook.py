"""What the patched SGLang calls: capture aux + last hidden states and write them per request.

Owns the SGLang side of the extraction boundary. The patch (patches/sglang/)
binds this module only when `SGLANG_HS_DUMP_DIR` is set and calls:

- `capture_layer_input(i, hidden_states, residual, forward_batch)` at the top of
  layer i (SGLang <= 0.5.13): the canonical state i is `hidden_states + residual`
  (residual is None before layer 0, where hidden_states is the embedding);
- `layer_collector(i, forward_batch, inner)` (SGLang >= 0.5.14): a collector the
  decoder layer hands that same sum to (`append` or `capture`), teeing into
  SGLang's own EAGLE-3 collector `inner` when there is one;
- `capture_final(hidden_states, forward_batch)` after the final norm. The token ids come
  from `forward_batch.input_ids`: Kimi-K2.5 (`KimiK25ForConditionalGeneration`) reaches
  the language model through `general_mm_embed_routine` with `input_ids=None`.

Only plain EXTEND forwards are dumped (`is_extend()` is also true for MIXED,
TARGET_VERIFY, DRAFT_EXTEND...), only on attention-TP rank 0 (= TP rank 0
without DP attention; every DP group's rank 0 with it, each holding its own
requests). Each request's rows become one chunk file
`{quote(key)}.{start}.safetensors` with absolute positions `[start, start+n)`;
the driver stitches chunks of a chunked prefill by position. The key is the
request id (`forward_batch.rids`, filled by `ForwardBatch.init_new` in every
supported release, 0.5.10 on); without request ids (older releases) the key is
`ids-` + sha256 of the token ids, which requires whole-prompt extends
(`--chunked-prefill-size -1 --disable-radix-cache`).

GPU tensors are copied into pinned host buffers with non_blocking copies on the
current stream (so later in-place updates of the residual cannot race them). A
host buffer is never read, sliced into a copy or handed back to the pool before
the CUDA event recorded after the forward's last copy has been waited on: the
writer thread waits on it, splits, and writes atomically, and only then returns
the buffers to the pool. The forward never waits on disk unless the writer falls
`MAX_PENDING` batches behind.

The hook refuses to run where its Python cannot see every forward (inside a CUDA
graph capture or a torch.compile trace: prefill/piecewise CUDA graphs) and where
the captured rows are not SGLang's all-reduced residual stream (FlashInfer
all-reduce fusion leaves a per-rank partial sum), naming the server option.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch
from safetensors.torch import save

from eagle3_dagster.io import atomic_write_bytes

ENV_DIR = "SGLANG_HS_DUMP_DIR"
ENV_LAYERS = "SGLANG_HS_DUMP_LAYERS"
CHUNK_FORMAT = "eagle3-hs-chunk/1"
MAX_PENDING = 4
SKIPPED_RID_PREFIXES = ("HEALTH_CHECK",)  # SGLang's /health_generate probe requests


def content_key(input_ids: list[int] | torch.Tensor) -> str:
    """Request key when SGLang has no rids: a hash of the whole prompt's token ids."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64).contiguous()
    return "ids-" + hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:32]


def chunk_filename(key: str, start: int) -> str:
    return f"{quote(key, safe='')}.{start}.safetensors"


def _default_rank() -> int:
    """Attention-TP rank from SGLang's parallel state (names differ across releases)."""
    try:
        from sglang.srt.distributed.parallel_state import get_attn_tensor_model_parallel_rank

        return int(get_attn_tensor_model_parallel_rank())
    except ImportError:
        from sglang.srt.layers.dp_attention import get_attention_tp_rank

        return int(get_attention_tp_rank())


def _as_list(batch, name: str) -> list[int]:
    cpu = getattr(batch, f"{name}_cpu", None)
    if cpu is not None:
        return [int(x) for x in cpu]
    value = getattr(batch, name, None)
    if value is None:
        raise ValueError(f"forward_batch has no {name} (nor {name}_cpu); cannot split rows per request")
    return [int(x) for x in (value.tolist() if hasattr(value, "tolist") else value)]


def _inside_graph_or_trace() -> bool:
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _refuse_partial_sum(t) -> None:
    # SGLang sets this marker in 0.5.10-0.5.20 only; from 0.5.21 the extraction launch's
    # --enforce-disable-flashinfer-allreduce-fusion alone guards (tests/unit/test_sglang_patch.py)
    if getattr(t, "_sglang_needs_allreduce_fusion", False):
        raise RuntimeError(
            "hidden-state dump: captured a layer output whose all-reduce is fused into the next layer "
            "(FlashInfer all-reduce fusion), a per-rank partial sum; launch the extraction server with "
            "--enforce-disable-flashinfer-allreduce-fusion and without --enable-flashinfer-allreduce-fusion"
        )


class _Collector:
    """Stands in for SGLang's aux collector on one layer (>= 0.5.14)."""

    def __init__(self, dumper: HiddenStateDumper, layer: int, inner) -> None:
        self._dumper, self._layer, self._inner = dumper, layer, inner

    def append(self, hidden: torch.Tensor) -> None:
        self._dumper._stage(self._layer, hidden)
        if self._inner is not None:
            self._inner.append(hidden)

    def capture(self, hidden: torch.Tensor, *, owned: bool = False) -> None:
        self._dumper._stage(self._layer, hidden)
        if self._inner is not None:
            self._inner.capture(hidden, owned=owned)


class HiddenStateDumper:
    """Per-process capture state; one forward at a time, as SGLang's model runner calls it."""

    def __init__(self, out_dir: str | os.PathLike, layers: list[int], rank_fn: Callable[[], int] | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.layers = sorted(layers)
        self._rank_fn = rank_fn
        self._rank: int | None = None
        self._staged: dict[int, torch.Tensor] = {}
        self._inflight: list[torch.Tensor] = []  # pinned buffers holding this forward's copies
        self._pool: list[torch.Tensor] = []
        self._pool_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_PENDING)
        self._error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, name="eagle3-hs-dump", daemon=True)
        self._writer.start()

    # -- called from the forward -------------------------------------------------

    def active(self, forward_batch) -> bool:
        if self._error is not None:
            raise RuntimeError(f"hidden-state dump writer failed: {self._error!r}") from self._error
        mode = forward_batch.forward_mode
        if getattr(mode, "name", mode) != "EXTEND":
            return False
        if _inside_graph_or_trace():
            raise RuntimeError(
                "hidden-state dump: the model forward is being captured into a CUDA graph or traced by "
                "torch.compile, so the dump would not run on replay; launch the extraction server with "
                "--disable-cuda-graph (and --disable-piecewise-cuda-graph where the release has it)"
            )
        if self._rank is None:
            self._rank = (self._rank_fn or _default_rank)()
        return self._rank == 0

    def capture_layer_input(self, layer: int, hidden_states, residual, forward_batch) -> None:
        if layer in self.layers and self.active(forward_batch):
            # The fusion flag sits on the layer output itself; the sum below is a fresh tensor without it.
            _refuse_partial_sum(hidden_states)
            self._stage(layer, hidden_states if residual is None else hidden_states + residual)

    def layer_collector(self, layer: int, forward_batch, inner):
        if layer in self.layers and self.active(forward_batch):
            return _Collector(self, layer, inner)
        return inner

    def capture_final(self, hidden_states: torch.Tensor, forward_batch) -> None:
        staged, self._staged = self._staged, {}
        buffers, self._inflight = self._inflight, []
        if not self.active(forward_batch):
            self._recycle(buffers)
            return
        missing = [i for i in self.layers if i not in staged]
        if missing:
            self._recycle(buffers)
            raise RuntimeError(
                f"hidden-state dump: layers {missing} were not captured in this forward "
                "(two-batch overlap and pipeline parallelism skip the capture; run without them)"
            )
        input_ids = getattr(forward_batch, "input_ids", None)
        if input_ids is None:
            self._recycle(buffers)
            raise RuntimeError("hidden-state dump: forward_batch.input_ids is missing; cannot key the rows")
        seq_lens = _as_list(forward_batch, "extend_seq_lens")
        prefix_lens = _as_list(forward_batch, "extend_prefix_lens")
        num_tokens = sum(seq_lens)
        if hidden_states.shape[0] < num_tokens or input_ids.shape[0] < num_tokens:
            self._recycle(buffers)
            raise RuntimeError(
                f"hidden-state dump: {hidden_states.shape[0]} rows for {num_tokens} tokens; the hidden states "
                "are scattered across ranks (DP attention / a2a MoE); run with plain TP"
            )
        rids = getattr(forward_batch, "rids", None)
        # Views of the staged host buffers, not copies: their device-to-host copies may still be in flight.
        tensors = {f"hidden.{i}": staged[i][:num_tokens] for i in self.layers}
        tensors["last_hidden"] = self._to_host(hidden_states[:num_tokens])
        tensors["input_ids"] = self._to_host(input_ids[:num_tokens].to(torch.int64))
        item: dict[str, Any] = {
            "seq_lens": seq_lens,
            "prefix_lens": prefix_lens,
            "rids": list(rids) if rids is not None else None,
            "tensors": tensors,
            "buffers": buffers + self._inflight,
            "event": None,
        }
        self._inflight = []
        if item["buffers"]:  # pooled host buffers exist only for device-to-host copies
            item["event"] = torch.cuda.Event()
            item["event"].record()  # on the current stream, after every copy above
        self._queue.put(item)

    def _stage(self, layer: int, hidden: torch.Tensor) -> None:
        _refuse_partial_sum(hidden)
        # Device-to-host now, on the current stream: later in-place updates are ordered after the copy.
        self._staged[layer] = self._to_host(hidden)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor that will equal `t` once this forward's event has been waited on."""
        if not t.is_cuda:
            return t.detach().clone()
        flat = self._take(t.numel(), t.dtype)
        self._inflight.append(flat)
        buf = flat[: t.numel()].view(t.shape)
        buf.copy_(t.detach(), non_blocking=True)
        return buf

    def _recycle(self, buffers: list[torch.Tensor]) -> None:
        """Buffers whose copies were issued but never read: free to reuse only after the stream passed them."""
        if buffers:
            event = torch.cuda.Event()
            event.record()
            event.synchronize()
            with self._pool_lock:
                self._pool.extend(buffers)

    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._pool_lock:
            for k, buf in enumerate(self._pool):
                if buf.dtype == dtype and buf.numel() >= numel:
                    return self._pool.pop(k)
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    # -- writer thread -------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if self._error is None:
                    self._write(item)
            except BaseException as e:  # surfaced to the forward by active()
                self._error = e
            finally:
                self._queue.task_done()

    def _write(self, item: dict) -> None:
        if item["event"] is not None:
            item["event"].synchronize()
        tensors: dict[str, torch.Tensor] = item["tensors"]
        offset = 0
        for j, (n, prefix) in enumerate(zip(item["seq_lens"], item["prefix_lens"])):
            rows = slice(offset, offset + n)
            offset += n
            ids = tensors["input_ids"][rows]
            if item["rids"] is not None:
                key = str(item["rids"][j])
                if key.startswith(SKIPPED_RID_PREFIXES):
                    continue
            elif prefix != 0:
                raise RuntimeError(
                    "hidden-state dump: this SGLang has no request ids, so prompts must be prefilled whole; "
                    "launch with --chunked-prefill-size -1 --disable-radix-cache"
                )
            else:
                key = content_key(ids)
            chunk = {name: t[rows].contiguous() for name, t in tensors.items()}
            meta = {
                "format": CHUNK_FORMAT,
                "key": key,
                "start": str(prefix),
                "length": str(n),
                "layers": ",".join(map(str, self.layers)),
                "numbering": "hf_output_hidden_states_index",
                "last_hidden": "post_norm",
            }
            atomic_write_bytes(self.out_dir / chunk_filename(key, prefix), save(chunk, metadata=meta))
        with self._pool_lock:
            self._pool.extend(item["buffers"])

    def flush(self) -> None:
        """Wait until every captured batch is on disk; re-raise a writer failure."""
        self._queue.join()
        if self._error is not None:
            raise RuntimeError(f"hidden-state dump writer failed: {self._error!r}") from self._error


_DUMPER: HiddenStateDumper | None = None


def get_dumper() -> HiddenStateDumper:
    """The process's dumper, configured from the environment on first use (not at import)."""
    global _DUMPER
    if _DUMPER is None:
        out_dir = os.environ.get(ENV_DIR)
        layers = os.environ.get(ENV_LAYERS)
        if not out_dir or not layers:
            raise RuntimeError(f"hidden-state dump needs {ENV_DIR} and {ENV_LAYERS} (canonical ids, e.g. 2,30,58)")
        _DUMPER = HiddenStateDumper(out_dir, [int(x) for x in layers.split(",")])
    return _DUMPER


def capture_layer_input(layer: int, hidden_states, residual, forward_batch) -> None:
    get_dumper().capture_layer_input(layer, hidden_states, residual, forward_batch)


def layer_collector(layer: int, forward_batch, inner):
    return get_dumper().layer_collector(layer, forward_batch, inner)


def capture_final(hidden_states, forward_batch) -> None:
    get_dumper().capture_final(hidden_states, forward_batch)
