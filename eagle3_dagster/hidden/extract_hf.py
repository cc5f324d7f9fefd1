"""The transformers (`hf`) extraction backend: run the target over a shard's samples, write the shard.

Owns: loading the target's decoder (no lm_head: logits over a 163k vocab are
never needed here), capturing exactly the configured aux layers with forward
hooks (so the other L-2 hidden states are never kept), length-bucketed padded
batches, and overlapping the forward of batch k+1 with writing batch k on a
background thread. The shard format and commit protocol are `shards`'; which
samples form a shard is `sharding`'s.

Numbering: canonical aux index i is the residual stream *entering* decoder
layer i (a forward pre-hook on `layers[i]`), which equals HF
`output_hidden_states[i]` and SGLang's `hidden_states + residual` before layer
i. `last_hidden` is the decoder output after the final norm.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_dagster.hidden.sharding import SampleRecord, ShardSpec, plan_shards, read_shard_records
from eagle3_dagster.hidden.shards import (
    ShardFormat,
    ShardWriter,
    is_shard_complete,
    load_shard_manifest,
    shard_path,
)
from eagle3_dagster.layers import validate_aux_layers

HF_BACKEND_CODE_VERSION = "hf-1"

Progress = Callable[[int, int], None]  # (tokens done, tokens in the shard)


@dataclass(frozen=True)
class ShardResult:
    key: str
    path: Path
    num_samples: int
    num_tokens: int
    num_bytes: int
    sha256: str
    seconds: float
    skipped: bool  # already complete per its manifest; nothing was computed


def load_target_hf(model_dir: Path, dtype: str, device: str | None = None) -> torch.nn.Module:
    """The target's decoder stack (`AutoModel`: embeddings, layers, final norm) in eval mode."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report would list lm_head.weight as unexpected: we leave it out on purpose
    try:
        model = AutoModel.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(device).eval()


class _AuxCapture:
    """Forward pre-hooks that keep the input of the aux layers for the current forward only."""

    def __init__(self, model: torch.nn.Module, aux_layers: list[int]) -> None:
        layers = model.layers
        self.aux_layers = validate_aux_layers(list(aux_layers), len(layers))
        self.states: dict[int, torch.Tensor] = {}
        self._handles = [layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True) for i in self.aux_layers]

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            self.states[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    def take(self) -> torch.Tensor:
        """[B, T, 3H] in canonical order; clears the captured states."""
        out = torch.cat([self.states[i] for i in self.aux_layers], dim=-1)
        self.states.clear()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def length_buckets(records: list[SampleRecord], batch_tokens: int) -> Iterator[list[SampleRecord]]:
    """Longest first, packed while B x longest (padded tokens) stays within batch_tokens."""
    order = sorted(records, key=lambda r: -len(r.input_ids))
    batch: list[SampleRecord] = []
    for r in order:
        longest = len(batch[0].input_ids) if batch else len(r.input_ids)
        if batch and (len(batch) + 1) * longest > batch_tokens:
            yield batch
            batch = []
        batch.append(r)
    if batch:
        yield batch


class _BackgroundWriter:
    """Moves finished batches to the CPU and into the shard while the next batch computes."""

    def __init__(self, writer: ShardWriter, progress: Progress | None, total: int) -> None:
        self.writer, self.progress, self.total, self.done = writer, progress, total, 0
        self.q: queue.Queue = queue.Queue(maxsize=2)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"shard-writer-{writer.key}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (item := self.q.get()) is not None:
            if self.error is not None:
                continue  # drain so the producer never blocks
            try:
                batch, aux, last = item
                aux, last = aux.cpu(), last.cpu()
                for b, r in enumerate(batch):
                    n = len(r.input_ids)
                    self.writer.write_sample(
                        r.id,
                        input_ids=torch.tensor(r.input_ids, dtype=torch.int64),
                        loss_mask=torch.tensor(r.loss_mask, dtype=torch.uint8),
                        aux_hidden=aux[b, :n],
                        last_hidden=last[b, :n],
                    )
                    self.done += n
                if self.progress is not None:
                    self.progress(self.done, self.total)
            except BaseException as e:  # surfaced in put()/finish()
                self.error = e

    def put(self, item) -> None:
        if self.error is not None:
            raise self.error
        self.q.put(item)

    def finish(self) -> None:
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def pad_batch(batch: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and attention mask for a length-sorted batch (longest first)."""
    longest = len(batch[0].input_ids)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for b, r in enumerate(batch):
        ids[b, : len(r.input_ids)] = torch.tensor(r.input_ids)
        mask[b, : len(r.input_ids)] = 1
    return ids, mask


@torch.inference_mode()
def _run_batches(model, capture: _AuxCapture, records, batch_tokens: int, sink: _BackgroundWriter) -> None:
    device = next(model.parameters()).device
    for batch in length_buckets(records, batch_tokens):
        ids, mask = pad_batch(batch)
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        sink.put((batch, capture.take(), out.last_hidden_state))


def extract_shard_hf(
    model_dir: Path,
    merged_train: Path,
    spec: ShardSpec,
    version_dir: Path,
    *,
    aux_layers: list[int],
    dtype: str,
    batch_tokens: int,
    target_identity: str,
    progress: Progress | None = None,
    model: torch.nn.Module | None = None,
    device: str | None = None,
) -> ShardResult:
    """Extract one shard unless its manifest already says it is complete (resume trusts the manifest)."""
    start = time.perf_counter()
    version_dir = Path(version_dir)
    if is_shard_complete(version_dir, spec.key, spec.sample_ids):
        entry = load_shard_manifest(version_dir, spec.key)
        return _result(spec, version_dir, entry, 0.0, skipped=True)
    model = model if model is not None else load_target_hf(model_dir, dtype, device)
    records = read_shard_records(merged_train, spec, vocab_size=model.config.vocab_size)
    fmt = ShardFormat(
        hidden_size=model.config.hidden_size, dtype=dtype, aux_layers=tuple(aux_layers),
        target_identity=target_identity, code_version=HF_BACKEND_CODE_VERSION,
    )
    capture = _AuxCapture(model, list(aux_layers))
    try:
        with ShardWriter(
            version_dir, spec.key, fmt, spec.sample_ids, spec.lengths, first_record=spec.first_record
        ) as writer:
            sink = _BackgroundWriter(writer, progress, spec.num_tokens)
            try:
                _run_batches(model, capture, records, batch_tokens, sink)
            finally:
                sink.finish()
    finally:
        capture.remove()
    return _result(spec, version_dir, writer.entry, time.perf_counter() - start, skipped=False)


def _result(spec: ShardSpec, version_dir: Path, entry: dict, seconds: float, *, skipped: bool) -> ShardResult:
    return ShardResult(
        key=spec.key, path=shard_path(version_dir, spec.key), num_samples=entry["num_samples"],
        num_tokens=entry["num_tokens"], num_bytes=entry["bytes"], sha256=entry["sha256"], seconds=seconds,
        skipped=skipped,
    )


def extract_all_hf(
    model_dir: Path,
    merged_train: Path,
    version_dir: Path,
    *,
    samples_per_shard: int,
    aux_layers: list[int],
    dtype: str,
    batch_tokens: int,
    target_identity: str,
    max_seq_len: int | None = None,
    device: str | None = None,
    progress: Progress | None = None,
) -> list[ShardResult]:
    """Every shard of merged_train with one loaded model (tests, benchmarks, single-host runs)."""
    specs = plan_shards(merged_train, samples_per_shard, max_seq_len=max_seq_len)
    model = None
    results = []
    for spec in specs:
        if model is None and not is_shard_complete(version_dir, spec.key, spec.sample_ids):
            model = load_target_hf(model_dir, dtype, device)
        results.append(
            extract_shard_hf(
                model_dir, merged_train, spec, version_dir, aux_layers=aux_layers, dtype=dtype,
                batch_tokens=batch_tokens, target_identity=target_identity, progress=progress, model=model,
            )
        )
    return results
