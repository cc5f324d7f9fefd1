"""The transformers (`hf`) extraction backend: run the target over a shard's samples, write the shard.

Owns: loading the target's decoder (no lm_head: logits over a 163k vocab are
never needed here), capturing exactly the configured aux layers with forward
hooks (so the other L-2 hidden states are never kept), length-bucketed padded
batches, and overlapping the forward of batch k+1 with writing batch k (the
forwards run on a background thread). It is a backend of `extract.extract_shard`,
which owns resume, the shard format and the commit; which samples form a shard is
`sharding`'s.

Numbering: canonical aux index i is the residual stream *entering* decoder
layer i (a forward pre-hook on `layers[i]`), which equals HF
`output_hidden_states[i]` and SGLang's `hidden_states + residual` before layer
i. `last_hidden` is the decoder output after the final norm.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from eagle3_dagster import storage
from eagle3_dagster.contracts import HF_BACKEND_CODE_VERSION
from eagle3_dagster.hidden.extract import Progress, Rows, ShardResult, extract_shard
from eagle3_dagster.hidden.sharding import SampleRecord, ShardSpec, plan_shards
from eagle3_dagster.hidden.shards import ShardFormat, is_shard_complete
from eagle3_dagster.layers import validate_aux_layers


def load_target_hf(model_dir: Path, dtype: str, device: str | None = None) -> torch.nn.Module:
    """The target's decoder stack (`AutoModel`: embeddings, layers, final norm) in eval mode."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "float8_e4m3fn":  # a storage format: compute in bf16 on a GPU, fp32 on a CPU, quantize when writing
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
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
        assert isinstance(layers, torch.nn.ModuleList)  # the decoder layers of a transformers model
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


def pad_batch(batch: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and attention mask for a length-sorted batch (longest first)."""
    longest = len(batch[0].input_ids)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for b, r in enumerate(batch):
        ids[b, : len(r.input_ids)] = torch.tensor(r.input_ids)
        mask[b, : len(r.input_ids)] = 1
    return ids, mask


def hf_rows(model: torch.nn.Module, aux_layers: list[int], batch_tokens: int) -> Callable[[list[SampleRecord]], Rows]:
    """The hf backend: (sample, aux, last) rows, the next batch's forward running while this one is written."""

    def rows(records: list[SampleRecord]) -> Rows:
        capture = _AuxCapture(model, list(aux_layers))
        results: queue.Queue = queue.Queue(maxsize=2)
        stop = threading.Event()

        @torch.inference_mode()
        def forwards() -> None:
            try:
                device = next(model.parameters()).device
                for batch in length_buckets(records, batch_tokens):
                    if stop.is_set():
                        return
                    ids, mask = pad_batch(batch)
                    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
                    results.put((batch, capture.take().cpu(), out.last_hidden_state.cpu()))
                results.put(None)
            except BaseException as e:  # re-raised in the consumer
                results.put(e)

        worker = threading.Thread(target=forwards, name="hf-forwards", daemon=True)
        worker.start()
        try:
            while (item := results.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                batch, aux, last = item
                for b, r in enumerate(batch):
                    n = len(r.input_ids)
                    yield r, aux[b, :n], last[b, :n]
        finally:
            stop.set()
            while worker.is_alive():  # unblock a producer waiting on a full queue
                try:
                    results.get(timeout=0.1)
                except queue.Empty:
                    pass
            capture.remove()

    return rows


def extract_shard_hf(
    model_dir: Path,
    merged_train: Path,
    spec: ShardSpec,
    version_dir: storage.Location | Path,
    *,
    aux_layers: list[int],
    dtype: str,
    batch_tokens: int,
    target_identity: str,
    progress: Progress | None = None,
    model: torch.nn.Module | None = None,
    device: str | None = None,
    code_version: str = HF_BACKEND_CODE_VERSION,
    log=lambda _line: None,
    staging_dir: Path | None = None,
    force: bool = False,
) -> ShardResult:
    """One shard through the hf backend (resume, format and commit are `extract_shard`'s); the model is
    loaded only if the shard has to be computed (`force`: even when complete)."""
    from functools import cache

    from eagle3_dagster.target import target_summary

    summary = cache(lambda: target_summary(Path(model_dir)))  # read only if the shard has to be computed

    def fmt() -> ShardFormat:
        return ShardFormat(
            hidden_size=summary()["hidden_size"],
            dtype=dtype,
            aux_layers=tuple(aux_layers),
            target_identity=target_identity,
            code_version=code_version,
        )

    def rows(records: list[SampleRecord]) -> Rows:
        loaded = model if model is not None else load_target_hf(model_dir, dtype, device)
        yield from hf_rows(loaded, aux_layers, batch_tokens)(records)

    return extract_shard(
        spec,
        merged_train,
        version_dir,
        fmt,
        rows,
        vocab_size=lambda: summary()["vocab_size"],
        progress=progress,
        log=log,
        staging_dir=staging_dir,
        force=force,
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
    staging_dir: Path | None = None,
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
                model_dir,
                merged_train,
                spec,
                version_dir,
                aux_layers=aux_layers,
                dtype=dtype,
                batch_tokens=batch_tokens,
                target_identity=target_identity,
                progress=progress,
                model=model,
                staging_dir=staging_dir,
            )
        )
    return results
