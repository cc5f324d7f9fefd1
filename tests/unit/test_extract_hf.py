"""The transformers backend: shards hold exactly the target's hidden states, resume after kill -9 is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3_dagster.hidden.extract_hf import extract_all_hf, extract_shard_hf, length_buckets, load_target_hf
from eagle3_dagster.hidden.estimate import actual_bytes, estimate_extraction
from eagle3_dagster.hidden.sharding import SampleRecord, plan_shards
from eagle3_dagster.hidden.dataset import HiddenStatesDataset
from eagle3_dagster.hidden.shards import ShardFormat, load_manifest, verify_shard
from eagle3_dagster.io import write_jsonl
from tests.child_process import kill_when_it_says

AUX = [1, 2, 3]
LENGTHS = [5, 17, 9, 30, 2, 12, 3]
SAMPLES_PER_SHARD = 3
BATCH_TOKENS = 40  # forces multi-sample batches with padding: 17 + 12 pad to 2 x 17, etc.


def _merged_train(path: Path, vocab: int) -> Path:
    g = torch.Generator().manual_seed(0)
    records = [
        {
            "id": f"sharegpt/{i}",
            "dataset": "sharegpt",
            "input_ids": torch.randint(0, vocab, (n,), generator=g).tolist(),
            "loss_mask": [int(j >= n // 2) for j in range(n)],
        }
        for i, n in enumerate(LENGTHS)
    ]
    write_jsonl(path, records)
    return path


def _extract(micro_target: Path, merged: Path, version_dir: Path, **kw):
    return extract_all_hf(
        micro_target,
        merged,
        version_dir,
        samples_per_shard=SAMPLES_PER_SHARD,
        aux_layers=AUX,
        dtype="float32",
        batch_tokens=BATCH_TOKENS,
        target_identity="micro",
        device="cpu",
        **kw,
    )


@pytest.fixture(scope="module")
def extracted(micro_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_extract")
    merged = _merged_train(root / "merged_train.jsonl", vocab=512)
    version_dir = root / "hidden" / "hs-000000000000"
    results = _extract(micro_target, merged, version_dir)
    return merged, version_dir, results


def test_batches_mix_lengths_so_padding_is_exercised():
    recs = [SampleRecord(id=str(i), input_ids=[0] * n, loss_mask=[0] * n) for i, n in enumerate(LENGTHS[:3])]
    batches = [[len(r.input_ids) for r in b] for b in length_buckets(recs, BATCH_TOKENS)]
    assert batches == [[17, 9], [5]]


def test_shards_equal_output_hidden_states_at_aux_layers_and_post_norm_last(micro_target, extracted):
    from transformers import AutoModelForCausalLM

    _, version_dir, results = extracted
    assert [r.key for r in results] == ["shard-00000", "shard-00001", "shard-00002"]
    model = AutoModelForCausalLM.from_pretrained(str(micro_target), dtype=torch.float32).eval()
    ds = HiddenStatesDataset(version_dir)
    assert ds.lengths() == LENGTHS and ds.metadata["aux_layers"] == AUX and ds.metadata["hidden_size"] == 64
    for i in range(len(ds)):
        s = ds[i]
        with torch.inference_mode():
            out = model(input_ids=s["input_ids"][None], output_hidden_states=True)
        hs = out.hidden_states
        expected_aux = torch.cat([hs[j][0] for j in AUX], dim=-1)
        torch.testing.assert_close(s["aux_hidden"], expected_aux, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(s["last_hidden"], hs[-1][0], atol=1e-5, rtol=1e-4)
        with torch.inference_mode():
            logits = model.lm_head(s["last_hidden"])
        torch.testing.assert_close(logits, out.logits[0], atol=1e-4, rtol=1e-4)  # post-norm: lm_head gives logits


def test_loss_mask_and_ids_travel_with_the_hidden_states(extracted):
    from eagle3_dagster.io import iter_jsonl

    merged, version_dir, _ = extracted
    ds = HiddenStatesDataset(version_dir)
    for rec, i in zip(iter_jsonl(merged), range(len(ds)), strict=True):
        s = ds[i]
        assert s["sample_id"] == rec["id"]
        assert s["input_ids"].tolist() == rec["input_ids"] and s["loss_mask"].tolist() == rec["loss_mask"]


def test_plan_predicts_the_bytes_the_hf_backend_writes_exactly(micro_target, extracted):
    merged, version_dir, results = extracted
    specs = plan_shards(merged, SAMPLES_PER_SHARD)
    fmt = ShardFormat(
        hidden_size=64, dtype="float32", aux_layers=tuple(AUX), target_identity="micro", code_version="hf-1"
    )
    fresh_root = version_dir.parent.parent / "empty_root"
    estimate = estimate_extraction(
        specs, fmt, fresh_root, version_dir.name, throughput_tokens_per_s=100.0, free_bytes=10**9
    )
    written = actual_bytes(version_dir, [s.key for s in specs])
    assert estimate.total_bytes == written
    assert estimate.shard_bytes == sum(r.num_bytes for r in results)
    assert estimate.estimated_hours == pytest.approx(sum(LENGTHS) / 100.0 / 3600.0)
    # against the real version folder, nothing remains to be written
    done = estimate_extraction(
        specs, fmt, version_dir.parent, version_dir.name, throughput_tokens_per_s=100.0, free_bytes=0
    )
    assert done.remaining_bytes == 0 and done.fits


def test_checksums_in_manifest_verify(extracted):
    _, version_dir, _ = extracted
    manifest = load_manifest(version_dir)
    assert sorted(manifest) == ["shard-00000", "shard-00001", "shard-00002"]  # an empty manifest verifies nothing
    for entry in manifest.values():
        verify_shard(version_dir / entry["file"], entry)


def test_complete_shard_is_skipped_without_loading_the_model(micro_target, extracted):
    merged, version_dir, _ = extracted
    spec = plan_shards(merged, SAMPLES_PER_SHARD)[0]
    result = extract_shard_hf(
        Path("/nonexistent/model"),
        merged,
        spec,
        version_dir,
        aux_layers=AUX,
        dtype="float32",
        batch_tokens=BATCH_TOKENS,
        target_identity="micro",
    )
    assert result.skipped and result.num_tokens == sum(LENGTHS[:3])


def test_token_outside_the_model_vocab_names_the_sample(micro_target, tmp_path):
    merged = tmp_path / "merged_train.jsonl"
    write_jsonl(merged, [{"id": "x/1", "input_ids": [1, 600], "loss_mask": [0, 1]}])
    with pytest.raises(ValueError, match=r"'x/1' has token id 600 outside the vocabulary \[0, 512\)"):
        _extract(micro_target, merged, tmp_path / "v")


_CHILD = """
import sys, threading
from pathlib import Path
from eagle3_dagster.hidden.extract_hf import extract_all_hf
version_dir = Path(sys.argv[3])

def progress(done, total):
    # Called after each sample is written. Once shard-00000 is committed, this is shard-00001 half-written:
    # say so and wait there for the kill, so the crash lands mid-shard whatever the machine's speed.
    if (version_dir / "shard-00000.manifest.json").exists():
        print("mid-shard", flush=True)
        threading.Event().wait()

extract_all_hf(Path(sys.argv[1]), Path(sys.argv[2]), version_dir, samples_per_shard={sps}, aux_layers={aux},
               dtype="float32", batch_tokens={bt}, target_identity="micro", device="cpu", progress=progress)
"""


@pytest.mark.slow  # an extraction subprocess killed and resumed
def test_resume_after_kill_writes_identical_shards(micro_target, extracted, tmp_path):
    merged, reference_dir, _ = extracted
    version_dir = tmp_path / "hs-000000000000"
    code = _CHILD.format(sps=SAMPLES_PER_SHARD, aux=AUX, bt=BATCH_TOKENS)
    # the child's word that shard-00001 is half-written
    kill_when_it_says(
        code, [str(micro_target), str(merged), str(version_dir)], "mid-shard", "before shard-00001 started"
    )
    assert not (version_dir / "shard-00001.manifest.json").exists()
    results = _extract(micro_target, merged, version_dir)
    assert results[0].skipped and not results[1].skipped and not results[2].skipped
    ref = sorted(p.name for p in reference_dir.iterdir())
    assert sorted(p.name for p in version_dir.iterdir()) == ref  # no temp files left behind
    for name in ref:
        assert (version_dir / name).read_bytes() == (reference_dir / name).read_bytes(), name


def test_model_loader_keeps_only_the_decoder(micro_target):
    model = load_target_hf(micro_target, "float32", "cpu")
    assert not hasattr(model, "lm_head") and len(model.layers) == 4
