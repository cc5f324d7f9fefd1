"""benchmarks/specforge_variant.py: SpecForge trains on exactly the samples our training trains on, never a held-out one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from eagle3_dagster.hidden.dataset import HiddenStatesDataset
from eagle3_dagster.hidden.export_formats import export_specforge
from eagle3_dagster.hidden.shards import ShardFormat, ShardWriter
from eagle3_dagster.train.data import split_heldout

ROOT = Path(__file__).resolve().parents[2]
H = 8
FRACTION = 0.25


def _variant():
    spec = importlib.util.spec_from_file_location("specforge_variant", ROOT / "benchmarks" / "specforge_variant.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _version(tmp_path: Path) -> Path:
    """40 samples in two shards; sample i's first token is i, so a feature file names its sample."""
    g = torch.Generator().manual_seed(0)
    fmt = ShardFormat(hidden_size=H, dtype="float32", aux_layers=(1, 2, 3), target_identity="t", code_version="c")
    version_dir = tmp_path / "hs-000000000000"
    for shard, first in (("shard-00000", 0), ("shard-00001", 20)):
        ids = [f"sharegpt/{i}" for i in range(first, first + 20)]
        lengths = [3 + i % 5 for i in range(first, first + 20)]
        with ShardWriter(version_dir, shard, fmt, ids, lengths) as w:
            for i, (sid, n) in enumerate(zip(ids, lengths), start=first):
                tokens = torch.randint(50, 100, (n,), generator=g)
                tokens[0] = i
                w.write_sample(
                    sid,
                    input_ids=tokens,
                    loss_mask=torch.ones(n, dtype=torch.long),
                    aux_hidden=torch.randn(n, 3 * H, generator=g),
                    last_hidden=torch.randn(n, H, generator=g),
                )
    return version_dir


def test_specforge_reads_only_the_samples_our_training_trains_on(tmp_path, monkeypatch):
    from tests.specforge_release import release_dir

    version_dir = _version(tmp_path)
    export_specforge(version_dir, tmp_path / "all")
    linked, heldout = _variant().link_training_samples(tmp_path / "all", tmp_path / "train", FRACTION)

    ds = HiddenStatesDataset(version_dir)
    ours_train, ours_heldout = split_heldout(ds, ds.sample_ids, FRACTION)  # what the training worker splits
    trained_on = {ds.sample_ids[i] for i in ours_train.indices}
    held_out = {ds.sample_ids[i] for i in ours_heldout.indices}
    assert held_out and trained_on  # the fraction holds some out, keeps the rest
    assert set(heldout) == held_out and set(linked) == trained_on

    # what SpecForge 0.2.0's own offline reader lists under the folder it is given, read back to sample ids
    monkeypatch.syspath_prepend(str(release_dir()))
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    files = list_feature_files(str(tmp_path / "train"))
    seen = {f"sharegpt/{int(load_feature_file(f)['input_ids'][0])}" for f in files}
    assert len(files) == len(trained_on) and seen == trained_on
    assert not seen & held_out


def test_a_second_linking_leaves_no_sample_of_another_split_behind(tmp_path):
    variant = _variant()
    export_specforge(_version(tmp_path), tmp_path / "all")
    variant.link_training_samples(tmp_path / "all", tmp_path / "train", 0.0)  # every sample
    linked, heldout = variant.link_training_samples(tmp_path / "all", tmp_path / "train", FRACTION)
    assert heldout and len(list((tmp_path / "train").rglob("*.ckpt"))) == len(linked)
