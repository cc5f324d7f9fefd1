"""vocab_mapping against a brute-force count, and d2t in the semantics SGLang loads (`d2t + arange`)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import orjson
import pytest
import torch
from safetensors import safe_open

from eagle3_dagster.data.vocab import build_vocab_mapping, select_draft_vocab


def _corpus(tmp_path, seed: int = 0, n: int = 60, vocab: int = 300):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        length = int(rng.integers(1, 40))
        ids = rng.zipf(1.3, length) % vocab  # skewed like real text, many ties in the tail
        mask = rng.integers(0, 2, length)
        recs.append({"id": f"d/{i}", "input_ids": ids.tolist(), "loss_mask": mask.tolist()})
    path = tmp_path / "merged.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    return path, recs


def test_draft_vocab_is_the_top_loss_masked_ids_ties_to_smaller_id_sorted_ascending(tmp_path):
    path, recs = _corpus(tmp_path)
    counter = Counter(t for r in recs for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    ranked = sorted(range(300), key=lambda t: (-counter.get(t, 0), t))  # brute force, unseen ids last by id
    expected = sorted(ranked[:50])
    stats = build_vocab_mapping([path], tmp_path / "vocab.safetensors", target_vocab_size=300, draft_vocab_size=50)
    with safe_open(tmp_path / "vocab.safetensors", "pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert d2t.dtype == torch.int64 and d2t.shape == (50,)
    assert t2d.dtype == torch.bool and t2d.shape == (300,)
    assert (d2t + torch.arange(50)).tolist() == expected  # what SGLang computes as hot_token_id
    assert torch.nonzero(t2d).flatten().tolist() == expected
    covered = sum(counter[t] for t in expected)
    assert stats.num_loss_tokens == sum(counter.values())
    assert stats.loss_token_coverage == pytest.approx(covered / sum(counter.values()))
    assert not stats.draft_vocab_covers_target


def test_a_target_vocab_smaller_than_the_draft_size_is_flagged_and_used_whole(tmp_path, caplog):
    path, _ = _corpus(tmp_path, vocab=40)
    stats = build_vocab_mapping([path], tmp_path / "v.safetensors", target_vocab_size=40, draft_vocab_size=64)
    assert stats.draft_vocab_covers_target and stats.draft_vocab_size == 40
    assert stats.loss_token_coverage == 1.0
    assert "not larger than the requested draft vocab" in caplog.text
    with safe_open(tmp_path / "v.safetensors", "pt") as f:
        assert f.get_tensor("d2t").tolist() == [0] * 40


def test_ties_and_unseen_ids_break_towards_the_smaller_id():
    counts = np.array([0, 5, 2, 5, 0, 2, 0])
    assert select_draft_vocab(counts, 3).tolist() == [1, 2, 3]
    assert select_draft_vocab(counts, 5).tolist() == [0, 1, 2, 3, 5]


def test_an_id_outside_the_target_vocab_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"input_ids":[1,2],"loss_mask":[1,1]}\n{"input_ids":[1,99],"loss_mask":[1,1]}\n')
    with pytest.raises(ValueError, match="m.jsonl:2"):
        build_vocab_mapping([path], tmp_path / "v.safetensors", target_vocab_size=10, draft_vocab_size=4)


def test_the_coverage_curve_is_what_the_top_n_ids_cover_up_to_the_whole_vocab(tmp_path):
    path, recs = _corpus(tmp_path, n=400, vocab=5000)
    counter = Counter(t for r in recs for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    stats = build_vocab_mapping([path], tmp_path / "v.safetensors", target_vocab_size=5000, draft_vocab_size=2048)
    total = sum(counter.values())
    top = sorted(counter.values(), reverse=True)
    assert list(stats.coverage_by_size) == ["1024", "2048", "4096", "5000"]
    for n, share in stats.coverage_by_size.items():
        assert share == pytest.approx(sum(top[: int(n)]) / total, abs=1e-6)
    assert stats.coverage_by_size["2048"] == pytest.approx(stats.loss_token_coverage, abs=1e-6)
    assert stats.coverage_by_size["5000"] == 1.0
