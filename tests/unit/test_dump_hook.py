"""The dump hook on CPU, driven the way the patched SGLang drives it.

`TinyLoopModel` mimics DeepseekV2Model.forward: embedding (+ absolute-position
embedding, so mislabelled positions show), a residual stream with fused add+norm
layers, the final norm, and the patch's calls, in both patch styles. Its layers
are per-token, so a chunked prefill yields the same states as a whole one, and
`reference_states` computes them HF-style for the whole prompt.
"""

from __future__ import annotations

from enum import IntEnum, auto
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from eagle3_dagster.sglang import dump_hook
from eagle3_dagster.sglang.dump_hook import HiddenStateDumper, chunk_filename, content_key


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
        self.mlps = torch.nn.ParameterList(torch.randn(hidden, hidden, generator=g) / hidden**0.5 for _ in range(num_layers))
        self.num_layers = num_layers

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, hook, style: str = "loop") -> torch.Tensor:
        hidden, residual = self.embed[input_ids] + self.pos[positions], None
        for i in range(self.num_layers):
            if style == "loop":
                hook.capture_layer_input(i, hidden, residual, forward_batch)
            residual = hidden if residual is None else hidden + residual
            if style == "collector":
                collector = hook.layer_collector(i, forward_batch, None)
                if collector is not None:
                    collector.append(residual)
            hidden = torch.tanh(self._norm(residual) @ self.mlps[i])
        final = self._norm(hidden + residual)
        hook.capture_final(final, input_ids, forward_batch)
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
