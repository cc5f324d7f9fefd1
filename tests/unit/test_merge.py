"""merged_train: deterministic bytes, drop list, truncation with recomputed masks, bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import orjson
import pytest

from eagle3_dagster.data import merge
from eagle3_dagster.data.merge import merge_and_shuffle, plot_length_histogram, scan_record, truncate_record
from eagle3_dagster.io import iter_jsonl


def _rec(dataset: str, i: int, ids: list[int], mask: list[int]) -> dict:
    return {"id": f"{dataset}/{i}", "dataset": dataset, "input_ids": ids, "loss_mask": mask, "source": "test"}


def _write(path: Path, records: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    files = {}
    for d in ("a", "b", "c"):
        recs = []
        for i in range(40):
            n = int(rng.integers(1, 12))
            recs.append(_rec(d, i, rng.integers(0, 500, n).tolist(), [0] * (n // 2) + [1] * (n - n // 2)))
        files[d] = _write(tmp_path / f"{d}.jsonl", recs)
    return files


def test_same_inputs_and_seed_give_the_same_bytes_and_a_permutation_of_the_input_lines(tmp_path, corpus):
    s1 = merge_and_shuffle(corpus, tmp_path / "m1.jsonl", max_seq_len=64, seed=7)
    merge_and_shuffle(dict(reversed(list(corpus.items()))), tmp_path / "m2.jsonl", max_seq_len=64, seed=7)
    merge_and_shuffle(corpus, tmp_path / "m3.jsonl", max_seq_len=64, seed=8)
    out = (tmp_path / "m1.jsonl").read_bytes()
    assert out == (tmp_path / "m2.jsonl").read_bytes()
    assert out != (tmp_path / "m3.jsonl").read_bytes()
    inputs = sorted(line for p in corpus.values() for line in p.read_bytes().splitlines())
    assert sorted(out.splitlines()) == inputs and out.splitlines() != inputs
    assert s1.num_records == 120 and s1.num_truncated == 0


def test_the_shuffle_depends_on_the_records_and_the_seed_not_on_the_order_they_were_written_in(tmp_path, corpus):
    """raw_responses logs answers in the order they complete, which depends on timing: two runs of the demo
    tokenized the same 1,001 records in different orders, and trained different drafters on them."""
    reordered = {}
    for d, path in corpus.items():
        lines = path.read_bytes().splitlines(keepends=True)
        reordered[d] = tmp_path / f"reordered-{d}.jsonl"
        reordered[d].write_bytes(b"".join(lines[::-1][1::2] + lines[::-1][0::2]))
    first = merge_and_shuffle(corpus, tmp_path / "first.jsonl", max_seq_len=64, seed=3)
    again = merge_and_shuffle(reordered, tmp_path / "again.jsonl", max_seq_len=64, seed=3)
    assert (tmp_path / "first.jsonl").read_bytes() == (tmp_path / "again.jsonl").read_bytes()
    assert first.as_dict() == again.as_dict()
    other_seed = merge_and_shuffle(corpus, tmp_path / "other.jsonl", max_seq_len=64, seed=4)
    assert (tmp_path / "other.jsonl").read_bytes() != (tmp_path / "first.jsonl").read_bytes()
    assert other_seed.num_records == first.num_records


def test_a_record_without_an_id_is_an_error_naming_its_file_and_line(tmp_path):
    path = _write(
        tmp_path / "a.jsonl", [_rec("a", 0, [1, 2], [0, 1]), {"dataset": "a", "input_ids": [1], "loss_mask": [1]}]
    )
    with pytest.raises(ValueError, match=r"a\.jsonl:2: .*\"id\""):
        merge_and_shuffle({"a": path}, tmp_path / "out.jsonl", max_seq_len=64, seed=0)


def test_dropped_datasets_are_left_out_and_counted_before_and_after(tmp_path, corpus):
    stats = merge_and_shuffle(corpus, tmp_path / "m.jsonl", max_seq_len=64, seed=1, drop_datasets=["b"])
    datasets = {r["dataset"] for r in iter_jsonl(tmp_path / "m.jsonl")}
    assert datasets == {"a", "c"}
    assert set(stats.before) == {"a", "b", "c"} and set(stats.after) == {"a", "c"}
    assert stats.num_records == 80
    expected_tokens = sum(len(r["input_ids"]) for d in ("a", "c") for r in iter_jsonl(corpus[d]))
    assert stats.num_tokens == expected_tokens
    assert sum(stats.token_share().values()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="not inputs"):
        merge_and_shuffle(corpus, tmp_path / "x.jsonl", max_seq_len=64, seed=1, drop_datasets=["zzz"])


def test_long_records_are_cut_with_their_mask_and_dropped_when_no_loss_token_survives(tmp_path):
    src = _write(
        tmp_path / "t.jsonl",
        [
            _rec("t", 0, list(range(10)), [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]),
            _rec("t", 1, list(range(10)), [0] * 7 + [1] * 3),  # every loss token beyond the cut
            _rec("t", 2, [5, 6, 7], [0, 1, 1]),
        ],
    )
    stats = merge_and_shuffle({"t": src}, tmp_path / "m.jsonl", max_seq_len=6, seed=0)
    out = {r["id"]: r for r in iter_jsonl(tmp_path / "m.jsonl")}
    assert set(out) == {"t/0", "t/2"}
    assert out["t/0"]["input_ids"] == [0, 1, 2, 3, 4, 5] and out["t/0"]["loss_mask"] == [0, 0, 0, 0, 1, 1]
    assert out["t/0"]["truncated"] is True and "truncated" not in out["t/2"]
    assert stats.num_truncated == 1 and stats.num_dropped_by_truncation == 1
    assert stats.num_tokens == 9 and stats.num_loss_tokens == 4
    assert stats.before["t"].tokens == 23 and stats.before["t"].loss_tokens == 11
    assert stats.lengths.tolist() == [6, 3] or stats.lengths.tolist() == [3, 6]
    png = plot_length_histogram(stats.lengths, tmp_path / "sequence_lengths.png", max_seq_len=6)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_byte_scan_counts_match_the_parsed_record():
    line = orjson.dumps(_rec("x", 0, [163839, 0, 12], [1, 0, 1])) + b"\n"
    assert scan_record(line, "x") == (3, 2)
    assert scan_record(b'{"input_ids": [ ], "loss_mask": []}', "x") == (0, 0)
    with pytest.raises(ValueError, match='f.jsonl:3: record has no "loss_mask"'):
        scan_record(b'{"input_ids": [1]}', "f.jsonl:3")


def test_byte_level_cut_equals_cutting_the_parsed_record():
    rec = _rec("x", 0, [10, 200, 3000, 40000, 5, 66], [0, 0, 1, 1, 0, 1])
    compact = orjson.dumps(rec) + b"\n"
    spaced = json.dumps(rec).encode() + b"\n"  # not compact: takes the parsing path
    for max_len in (1, 3, 5):
        cut = truncate_record(compact, max_len, "x")
        if max_len < 3:
            assert cut is None and truncate_record(spaced, max_len, "x") is None
            continue
        expected = {
            **rec,
            "input_ids": rec["input_ids"][:max_len],
            "loss_mask": rec["loss_mask"][:max_len],
            "truncated": True,
        }
        assert orjson.loads(cut) == expected == orjson.loads(truncate_record(spaced, max_len, "x"))


def test_chunk_boundaries_long_lines_and_a_missing_final_newline_change_nothing(tmp_path, corpus, monkeypatch):
    reference = merge_and_shuffle(corpus, tmp_path / "ref.jsonl", max_seq_len=8, seed=3)
    unterminated = tmp_path / "a_no_newline.jsonl"
    unterminated.write_bytes(corpus["a"].read_bytes().rstrip(b"\n"))
    monkeypatch.setattr(merge, "_CHUNK", 64)  # smaller than most lines: every line spans chunks
    small = merge_and_shuffle({**corpus, "a": unterminated}, tmp_path / "small.jsonl", max_seq_len=8, seed=3)
    assert (tmp_path / "small.jsonl").read_bytes() == (tmp_path / "ref.jsonl").read_bytes()
    assert small.as_dict() == reference.as_dict()


_MERGE_IN_CHILD = textwrap.dedent("""
    import sys
    from eagle3_dagster.data.merge import merge_and_shuffle
    src, out = sys.argv[1:]
    merge_and_shuffle({"big": src}, out, max_seq_len=4096, seed=0)
    # VmHWM, not ru_maxrss: ru_maxrss survives exec and would include the forked pytest process
    status = open("/proc/self/status").read()
    print(int(status.split("VmHWM:")[1].split()[0]) // 1024)
""")


@pytest.mark.slow  # a 150 MB corpus
def test_peak_memory_stays_bounded_on_a_corpus_far_larger_than_the_bound(tmp_path):
    rng = np.random.default_rng(0)
    src = tmp_path / "big.jsonl"
    pool = ",".join(str(i) for i in rng.integers(0, 163840, 20_000)).encode()  # ~140 KB of ids to slice from
    commas = np.flatnonzero(np.frombuffer(pool, dtype=np.uint8) == ord(","))
    ones = b"1," * 5000
    with open(src, "wb") as f:
        for i in range(9000):
            n = int(rng.integers(500, 5000))  # some beyond max_seq_len, so truncation runs too
            ids = pool[: commas[n - 1]]  # the first n ids
            f.write(
                b'{"id":"big/%d","dataset":"big","input_ids":[%s],"loss_mask":[%s]}\n' % (i, ids, ones[: 2 * n - 1])
            )
    assert src.stat().st_size > 150e6
    done = subprocess.run(
        [sys.executable, "-c", _MERGE_IN_CHILD, str(src), str(tmp_path / "m.jsonl")], capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    peak_mb = int(done.stdout.split()[-1])
    assert peak_mb <= 64, f"merge peaked at {peak_mb} MB on a {src.stat().st_size / 1e6:.0f} MB corpus"
    assert (tmp_path / "m.jsonl").stat().st_size > 100e6
