"""The dump hook on CPU, driven the way the patched SGLang drives it.

`TinyLoopModel` mimics DeepseekV2Model.forward: embedding (+ absolute-position
embedding, so mislabelled positions show), a residual stream updated in place as
SGLang's fused add+norm does, the final norm, and the patch's calls, in both patch
styles. `KimiWrapper` calls it the way `KimiK25ForConditionalGeneration` does
(through `general_mm_embed_routine`: `input_ids=None`, embeddings passed in; the ids
live on the forward batch). Its layers are per-token, so a chunked prefill yields
the same states as a whole one, and `reference_states` computes them HF-style for
the whole prompt. `tests/cuda_emulation.py` gives the GPU's copy ordering.
"""

from __future__ import annotations

from enum import IntEnum, auto
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from eagle3_dagster.sglang import dump_hook
from eagle3_dagster.sglang.dump_hook import HiddenStateDumper, chunk_filename, content_key
from tests.cuda_emulation import lagging_cuda, to_device


class ForwardMode(IntEnum):  # SGLang's enum (0.5.6 forward_batch_info.py), by name
    EXTEND = auto()
    DECODE = auto()
    MIXED = auto()
    IDLE = auto()
    TARGET_VERIFY = auto()
    DRAFT_EXTEND = auto()
    DRAFT_EXTEND_V2 = auto()


class TinyLoopModel(torch.nn.Module):
    def __init__(self, vocab: int = 50, hidden: int = 8, num_layers: int = 5, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(256, hidden, generator=g))
        self.mlps = torch.nn.ParameterList(
            torch.randn(hidden, hidden, generator=g) / hidden**0.5 for _ in range(num_layers)
        )
        self.num_layers = num_layers

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def embed_tokens(self, input_ids, positions) -> torch.Tensor:
        return self.embed[input_ids] + self.pos[positions]

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, hook, style: str = "loop", input_embeds=None):
        hidden = self.embed_tokens(input_ids, positions) if input_embeds is None else input_embeds
        residual = None
        for i in range(self.num_layers):
            if style == "loop":
                hook.capture_layer_input(i, hidden, residual, forward_batch)
            if residual is None:
                residual = hidden.clone()
            else:
                residual.add_(hidden)  # in place, as SGLang's fused add+RMSNorm updates the residual
            if style == "collector":
                collector = hook.layer_collector(i, forward_batch, None)
                if collector is not None:
                    collector.append(residual)
            hidden = torch.tanh(self._norm(residual) @ self.mlps[i])
        final = self._norm(hidden + residual)
        hook.capture_final(final, forward_batch)
        return final

    @torch.no_grad()
    def reference_states(self, input_ids: list[int]) -> list[torch.Tensor]:
        """HF output_hidden_states for one whole prompt: index i = before layer i, last = post-norm."""
        ids = torch.tensor(input_ids)
        x = self.embed[ids] + self.pos[torch.arange(len(ids))]
        states = [x]
        for i in range(self.num_layers):
            x = x + torch.tanh(self._norm(x) @ self.mlps[i])
            states.append(x)
        states[-1] = self._norm(states[-1])
        return states


class KimiWrapper(torch.nn.Module):
    """KimiK25ForConditionalGeneration's convention: the language model gets input_ids=None."""

    def __init__(self, language_model: TinyLoopModel):
        super().__init__()
        self.language_model = language_model

    def forward(self, input_ids, positions, forward_batch, hook, style: str = "loop"):
        embeds = self.language_model.embed_tokens(input_ids, positions)
        return self.language_model(None, positions, forward_batch, hook, style, input_embeds=embeds)


def extend_batch(requests: list[tuple[str | None, list[int], int]], mode=ForwardMode.EXTEND, cpu_lists: bool = True):
    """(rid, ids of this extend, prefix_len) per request -> flat input_ids, positions, ForwardBatch-shaped object."""
    seq = [len(ids) for _, ids, _ in requests]
    prefix = [p for _, _, p in requests]
    batch = SimpleNamespace(
        forward_mode=mode,
        extend_seq_lens=torch.tensor(seq, dtype=torch.int32),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        extend_start_loc=torch.tensor([sum(seq[:j]) for j in range(len(seq))], dtype=torch.int32),
    )
    if cpu_lists:
        batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu = seq, prefix
    if all(rid is not None for rid, _, _ in requests):
        batch.rids = [rid for rid, _, _ in requests]
    input_ids = torch.tensor([t for _, ids, _ in requests for t in ids])
    positions = torch.cat([torch.arange(p, p + len(ids)) for _, ids, p in requests])
    batch.input_ids = input_ids
    return input_ids, positions, batch


def read_chunk(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


LAYERS = [1, 2, 4]


@pytest.fixture
def model():
    return TinyLoopModel()


@pytest.mark.parametrize("style", ["loop", "collector"])
def test_mixed_lengths_split_per_request_match_reference_states(model, tmp_path, style):
    dumper = HiddenStateDumper(tmp_path, LAYERS, rank_fn=lambda: 0)
    prompts = {"a": [3, 4, 5], "b/sample:1": list(range(10, 21)), "c": [7]}
    ids, pos, batch = extend_batch([(rid, p, 0) for rid, p in prompts.items()])
    model(ids, pos, batch, dumper, style)
    dumper.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(chunk_filename(r, 0) for r in prompts)
    for rid, prompt in prompts.items():
        tensors, meta = read_chunk(tmp_path / chunk_filename(rid, 0))
        ref = model.reference_states(prompt)
        assert tensors["input_ids"].tolist() == prompt
        for layer in LAYERS:
            torch.testing.assert_close(tensors[f"hidden.{layer}"], ref[layer])
        torch.testing.assert_close(tensors["last_hidden"], ref[-1])
        assert meta["key"] == rid and meta["start"] == "0" and meta["layers"] == "1,2,4"


def test_prefix_hits_offset_positions_and_chunked_prefill_stitches(model, tmp_path):
    dumper = HiddenStateDumper(tmp_path, LAYERS, rank_fn=lambda: 0)
    long, short = list(range(1, 14)), [5, 6, 7, 8]
    # forward 1: first chunk of `long` (6 tokens) next to the whole of `short`
    ids, pos, batch = extend_batch([("long", long[:6], 0), ("short", short, 0)], cpu_lists=False)
    model(ids, pos, batch, dumper)
    # forward 2: the rest of `long`, whose first 6 tokens are now a prefix
    ids, pos, batch = extend_batch([("long", long[6:], 6)])
    model(ids, pos, batch, dumper)
    dumper.flush()
    first, _ = read_chunk(tmp_path / chunk_filename("long", 0))
    second, meta = read_chunk(tmp_path / chunk_filename("long", 6))
    assert meta["start"] == "6" and meta["length"] == "7"
    ref = model.reference_states(long)
    for layer in LAYERS:
        torch.testing.assert_close(torch.cat([first[f"hidden.{layer}"], second[f"hidden.{layer}"]]), ref[layer])
    assert torch.cat([first["input_ids"], second["input_ids"]]).tolist() == long


@pytest.mark.parametrize("mode", [m for m in ForwardMode if m is not ForwardMode.EXTEND])
def test_non_extend_modes_write_nothing(model, tmp_path, mode):
    dumper = HiddenStateDumper(tmp_path, LAYERS, rank_fn=lambda: 0)
    ids, pos, batch = extend_batch([("a", [1, 2, 3], 0)], mode=mode)
    model(ids, pos, batch, dumper, "collector")
    model(ids, pos, batch, dumper, "loop")
    dumper.flush()
    assert list(tmp_path.iterdir()) == []


def test_non_zero_attention_tp_rank_is_silent(model, tmp_path):
    dumper = HiddenStateDumper(tmp_path, LAYERS, rank_fn=lambda: 3)
    ids, pos, batch = extend_batch([("a", [1, 2, 3], 0)])
    model(ids, pos, batch, dumper)
    dumper.flush()
    assert list(tmp_path.iterdir()) == []


def test_without_rids_requests_are_keyed_by_content_and_chunks_are_refused(model, tmp_path):
    dumper = HiddenStateDumper(tmp_path, LAYERS, rank_fn=lambda: 0)
    ids, pos, batch = extend_batch([(None, [9, 8, 7], 0), (None, [1, 2], 0)])
    model(ids, pos, batch, dumper)
    dumper.flush()
    assert (tmp_path / chunk_filename(content_key([9, 8, 7]), 0)).exists()
    ids, pos, batch = extend_batch([(None, [3, 4], 5)])
    model(ids, pos, batch, dumper)
    with pytest.raises(RuntimeError, match="chunked-prefill-size -1"):
        dumper.flush()
    with pytest.raises(RuntimeError, match="writer failed"):  # the next forward fails loudly too
        model(ids, pos, batch, dumper)


def test_health_probe_requests_and_padding_rows_are_ignored(model, tmp_path):
    dumper = HiddenStateDumper(tmp_path, LAYERS, rank_fn=lambda: 0)
    ids, pos, batch = extend_batch([("HEALTH_CHECK_abc", [0], 0), ("x", [4, 5], 0)])
    ids, pos = torch.cat([ids, torch.zeros(5, dtype=ids.dtype)]), torch.cat([pos, torch.zeros(5, dtype=pos.dtype)])
    model(ids, pos, batch, dumper)
    dumper.flush()
    assert [p.name for p in tmp_path.iterdir()] == [chunk_filename("x", 0)]
    assert read_chunk(tmp_path / chunk_filename("x", 0))[0]["last_hidden"].shape == (2, 8)


def test_missing_layer_in_a_forward_is_an_error(model, tmp_path):
    dumper = HiddenStateDumper(tmp_path, [1, 2, 9], rank_fn=lambda: 0)
    ids, pos, batch = extend_batch([("a", [1, 2], 0)])
    with pytest.raises(RuntimeError, match=r"layers \[9\] were not captured"):
        model(ids, pos, batch, dumper)


def test_module_functions_configure_from_environment_on_first_call(model, tmp_path, monkeypatch):
    monkeypatch.setattr(dump_hook, "_DUMPER", None)
    monkeypatch.setenv(dump_hook.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(dump_hook.ENV_LAYERS, "1,2,4")
    monkeypatch.setattr(dump_hook, "_default_rank", lambda: 0)
    ids, pos, batch = extend_batch([("m", [1, 2, 3], 0)])
    model(ids, pos, batch, dump_hook, "collector")
    dump_hook.get_dumper().flush()
    assert (tmp_path / chunk_filename("m", 0)).exists()


@pytest.mark.parametrize("style", ["loop", "collector"])
def test_kimi_wrapper_without_input_ids_dumps_ids_from_the_forward_batch(model, tmp_path, style):
    dumper = HiddenStateDumper(tmp_path, LAYERS, rank_fn=lambda: 0)
    prompts = {"k1": [3, 4, 5, 6], "k2": [9, 1]}
    ids, pos, batch = extend_batch([(rid, p, 0) for rid, p in prompts.items()])
    KimiWrapper(model)(ids, pos, batch, dumper, style)
    dumper.flush()
    for rid, prompt in prompts.items():
        tensors, _ = read_chunk(tmp_path / chunk_filename(rid, 0))
        assert tensors["input_ids"].tolist() == prompt
        torch.testing.assert_close(tensors["hidden.2"], model.reference_states(prompt)[2])


@pytest.mark.parametrize("style", ["loop", "collector"])
@pytest.mark.parametrize("wrapper", ["deepseek", "kimi"])
def test_async_copies_are_read_only_after_their_event_across_batches(model, tmp_path, monkeypatch, style, wrapper):
    """GPU lags the CPU: every stored tensor equals its source, several requests per batch, buffers reused."""
    stream = lagging_cuda(monkeypatch)
    forward = KimiWrapper(model) if wrapper == "kimi" else model  # device ids make every activation a device tensor
    dumper = HiddenStateDumper(tmp_path, LAYERS, rank_fn=lambda: 0)
    batches = [
        {"a": [3, 4, 5], "b": list(range(10, 21)), "c": [7]},
        {"d": [8, 9, 10, 11, 12], "e": [1, 2]},  # reuses the first batch's pooled buffers
        {"f": list(range(20, 40)), "g": [5], "h": [6, 7]},
    ]
    for n, prompts in enumerate(batches):
        if n == len(batches) - 1:
            stream.gate.clear()  # the GPU falls behind: the writer's event wait blocks until the gate opens
        ids, pos, batch = extend_batch([(rid, p, 0) for rid, p in prompts.items()])
        batch.input_ids = to_device(batch.input_ids)
        forward(to_device(ids), to_device(pos), batch, dumper, style)
    assert stream.issued > stream.landed  # the last forward returned with its copies still in flight
    stream.gate.set()
    dumper.flush()
    for prompts in batches:
        for rid, prompt in prompts.items():
            tensors, _ = read_chunk(tmp_path / chunk_filename(rid, 0))
            ref = model.reference_states(prompt)
            assert tensors["input_ids"].tolist() == prompt
            for layer in LAYERS:
                torch.testing.assert_close(tensors[f"hidden.{layer}"], ref[layer])
            torch.testing.assert_close(tensors["last_hidden"], ref[-1])


def test_fused_allreduce_partial_sum_is_refused_naming_the_option(model, tmp_path):
    dumper = HiddenStateDumper(tmp_path, LAYERS, rank_fn=lambda: 0)
    ids, pos, batch = extend_batch([("a", [1, 2, 3], 0)])
    hidden = torch.randn(3, 8)
    hidden._sglang_needs_allreduce_fusion = True  # SGLang marks the MLP output it did not all-reduce
    with pytest.raises(RuntimeError, match="enforce-disable-flashinfer-allreduce-fusion"):
        dumper.capture_layer_input(1, hidden, torch.randn(3, 8), batch)


def test_forward_inside_a_graph_capture_or_compile_trace_is_refused(model, tmp_path, monkeypatch):
    dumper = HiddenStateDumper(tmp_path, LAYERS, rank_fn=lambda: 0)
    ids, pos, batch = extend_batch([("a", [1, 2, 3], 0)])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="--disable-cuda-graph"):
        model(ids, pos, batch, dumper)


def _sglang_aux_module(version: str):
    """SGLang's own aux collectors (`srt/layers/aux_hidden_states.py`, plain Python) from the release wheel."""
    import types

    from tests import sglang_wheels

    module = types.ModuleType(f"sglang_aux_{version}")
    exec(
        compile(sglang_wheels.read_file(version, "sglang/srt/layers/aux_hidden_states.py"), module.__name__, "exec"),
        module.__dict__,
    )
    return module


@pytest.mark.parametrize("collector", ["AuxHiddenStatePacker", "AuxHiddenStateList"])
def test_dump_equals_what_sglangs_own_eagle3_collector_hands_the_draft_model(model, tmp_path, collector):
    """0.5.23's decoder layers call `capture(value, owned=...)` on the collector the patch passes; the dump's
    collector tees into SGLang's real one, and both must hold the same states for the EAGLE-3 layers."""
    aux = _sglang_aux_module("0.5.23")
    eagle_layers = [1, 2, 4]
    inner = (
        aux.AuxHiddenStatePacker(len(eagle_layers)) if collector == "AuxHiddenStatePacker" else aux.AuxHiddenStateList()
    )
    dumper = HiddenStateDumper(tmp_path, LAYERS, rank_fn=lambda: 0)
    prompts = {"p": [3, 4, 5, 6], "q": [9, 8]}
    ids, pos, batch = extend_batch([(rid, p, 0) for rid, p in prompts.items()])
    hidden, residual = model.embed_tokens(ids, pos), None
    with torch.no_grad():
        for i in range(model.num_layers):
            residual = hidden.clone() if residual is None else residual.add_(hidden)
            c = dumper.layer_collector(i, batch, inner if i in eagle_layers else None)
            if c is not None:
                c.capture(residual, owned=False)  # borrowed: the residual is updated in place afterwards
            hidden = torch.tanh(model._norm(residual) @ model.mlps[i])
        dumper.capture_final(model._norm(hidden + residual), batch)
    dumper.flush()
    served = aux.pack_aux_hidden_states(inner.finalize() if collector == "AuxHiddenStatePacker" else inner)
    offset = 0
    for rid, prompt in prompts.items():
        tensors, _ = read_chunk(tmp_path / chunk_filename(rid, 0))
        rows = slice(offset, offset + len(prompt))
        offset += len(prompt)
        dumped = torch.cat([tensors[f"hidden.{i}"] for i in eagle_layers], dim=-1)
        torch.testing.assert_close(dumped, served[rows])
