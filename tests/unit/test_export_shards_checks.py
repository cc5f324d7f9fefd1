"""`eagle3 export-shards` hands another trainer only shards training would accept, into a folder of its own.

Before: a shard failing its checksum (which training refuses with ShardCorruptError) was exported to
SpecForge and speculators silently, and an export into the folder of an earlier one left the earlier
files there (25 .ckpt for 24 samples; SpecForge reads every .ckpt below the folder), or mixed the samples
with whatever else the folder held.
"""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from eagle3_dagster.hidden.export_formats import export_specforge, export_speculators, specforge_target_dir
from eagle3_dagster.hidden.shards import ShardCorruptError, ShardFormat, ShardWriter, shard_path

H = 8
ROOT = Path(__file__).resolve().parents[2]


def _version(path: Path, num_samples: int, per_shard: int = 12) -> Path:
    """A hidden-state version as extraction writes it: shards of `per_shard` samples, each with its manifest."""
    g = torch.Generator().manual_seed(num_samples)
    fmt = ShardFormat(hidden_size=H, dtype="float32", aux_layers=(1, 2, 3), target_identity="t", code_version="c")
    ids = [f"sharegpt/{i}" for i in range(num_samples)]
    for start in range(0, num_samples, per_shard):
        chunk = ids[start : start + per_shard]
        with ShardWriter(
            path, f"shard-{start // per_shard:05d}", fmt, chunk, [3 + i % 4 for i in range(len(chunk))]
        ) as w:
            for i, sid in enumerate(chunk):
                n = 3 + i % 4
                w.write_sample(
                    sid,
                    input_ids=torch.randint(0, 50, (n,), generator=g),
                    loss_mask=torch.randint(0, 2, (n,), generator=g),
                    aux_hidden=torch.randn(n, 3 * H, generator=g),
                    last_hidden=torch.randn(n, H, generator=g),
                )
    return path


def _corrupt(version_dir: Path, key: str) -> None:
    """One flipped bit in the states of a shard, its size unchanged: what a bad disk or a torn copy leaves."""
    path = Path(str(shard_path(version_dir, key)))
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10
    path.write_bytes(bytes(data))


def _export(fmt: str, version_dir: Path, out: Path) -> int:
    if fmt == "specforge":
        return export_specforge(version_dir, out)
    return export_speculators(version_dir, out, final_norm_weight=torch.ones(H))


def _samples(fmt: str, out: Path) -> list[str]:
    pattern = "*.ckpt" if fmt == "specforge" else "hs_*.safetensors"
    return sorted(p.name for p in out.rglob(pattern))


def _tree(out: Path) -> dict[str, bytes | str]:
    return {
        str(p.relative_to(out)): (os.readlink(p) if p.is_symlink() else p.read_bytes())
        for p in sorted(out.rglob("*"))
        if p.is_file() or p.is_symlink()
    }


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_a_shard_failing_its_checksum_is_not_exported(fmt, tmp_path):
    version_dir = _version(tmp_path / "hs-1", 24)
    _corrupt(version_dir, "shard-00001")
    out = tmp_path / "out"
    with pytest.raises(ShardCorruptError, match=r"1 of 2 shards do not match.*shard-00001.*sha256"):
        _export(fmt, version_dir, out)
    assert not out.exists() or _samples(fmt, out) == []


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_an_export_into_an_earlier_export_replaces_it_whole(fmt, tmp_path):
    out = tmp_path / "out"
    assert _export(fmt, _version(tmp_path / "hs-25", 25), out) == 25
    assert len(_samples(fmt, out)) == 25
    assert _export(fmt, _version(tmp_path / "hs-24", 24), out) == 24
    assert len(_samples(fmt, out)) == 24  # before: 25, the 25th from the earlier export
    marker = json.loads((out / "eagle3_export.json").read_text())
    assert marker["layout"] == fmt and marker["complete"] and marker["num_samples"] == len(marker["sample_ids"]) == 24
    fresh = tmp_path / "fresh"
    _export(fmt, tmp_path / "hs-24", fresh)
    assert _tree(out) == _tree(fresh)  # nothing of the earlier export is left


def test_an_export_replaces_an_earlier_one_of_the_other_layout_and_one_that_was_killed(tmp_path):
    version_dir = _version(tmp_path / "hs", 24)
    out = tmp_path / "out"
    export_specforge(version_dir, out)
    export_speculators(version_dir, out, final_norm_weight=torch.ones(H))
    assert _samples("specforge", out) == [] and len(_samples("speculators", out)) == 24
    # killed midway: the marker (written before the first sample) says incomplete; a temp file is left
    (out / "eagle3_export.json").write_text(
        json.dumps({"format": "eagle3-dagster-hidden-export", "layout": "specforge", "complete": False})
    )
    (out / "rows_0-2000").mkdir()
    (out / "rows_0-2000" / ".data_3.ckpt.host-123.abcd.tmp").write_bytes(b"half")
    assert export_specforge(version_dir, out) == 24
    assert sorted(p.name for p in out.iterdir()) == ["eagle3_export.json", "rows_0-2000"]
    assert len(list((out / "rows_0-2000").iterdir())) == 24


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_a_folder_holding_anything_else_is_refused_and_left_as_it_is(fmt, tmp_path):
    version_dir = _version(tmp_path / "hs", 24)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"notes: not empty \(README.txt\) and not an earlier export"):
        _export(fmt, version_dir, notes)
    assert _tree(notes) == {"README.txt": b"mine"}  # before: samples written beside it

    earlier = tmp_path / "earlier"
    _export(fmt, version_dir, earlier)
    extra = earlier / ("rows_0-2000" if fmt == "specforge" else "hidden_states") / "mine.ckpt"
    extra.write_bytes(b"someone else's sample")
    before = _tree(earlier)
    with pytest.raises(
        FileExistsError, match=r"an earlier export, but it also holds \['(rows_0-2000|hidden_states)'\]"
    ):
        _export(fmt, version_dir, earlier)
    assert _tree(earlier) == before  # refused before anything is removed

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(FileExistsError, match="is not a folder"):
        _export(fmt, version_dir, a_file)


def test_links_in_an_earlier_export_are_never_followed_when_it_is_replaced(tmp_path):
    version_dir = _version(tmp_path / "hs", 24)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data_0.ckpt").write_bytes(b"keep me")
    out = tmp_path / "out"
    export_specforge(version_dir, out)
    os.symlink(precious, out / "rows_2000-4000")  # a linked folder named like a sample group
    with pytest.raises(FileExistsError, match=r"rows_2000-4000"):
        export_specforge(version_dir, out)
    (out / "rows_2000-4000").unlink()
    marker = out / "eagle3_export.json"
    real_marker = tmp_path / "marker.json"
    marker.rename(real_marker)
    marker.symlink_to(real_marker)  # a marker that is a link is not this project's
    with pytest.raises(FileExistsError, match="not an earlier export"):
        export_specforge(version_dir, out)
    assert (precious / "data_0.ckpt").read_bytes() == b"keep me" and real_marker.exists()


def _weights_target(d: Path, seed: int) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=H,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=4,
        vocab_size=50,
    ).save_pretrained(str(d))
    g = torch.Generator().manual_seed(seed)
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(50, H, generator=g),
            "lm_head.weight": torch.randn(50, H, generator=g),
            "model.norm.weight": torch.rand(H, generator=g) + 0.5,
        },
        str(d / "model.safetensors"),
    )
    return d


def test_the_specforge_target_view_is_rebuilt_for_another_target(tmp_path):
    """Before, a link of the earlier target stayed (a name already linked was skipped): SpecForge's TargetHead
    would have read the earlier target's lm_head under the new target's index."""
    first, second = _weights_target(tmp_path / "first", 1), _weights_target(tmp_path / "second", 2)
    out = tmp_path / "out"
    export_specforge(_version(tmp_path / "hs", 4), out)
    specforge_target_dir(first, out)
    view = specforge_target_dir(second, out)
    assert {p.name: p.resolve() for p in view.iterdir() if p.is_symlink()} == {
        p.name: p.resolve() for p in second.iterdir()
    }
    export_specforge(tmp_path / "hs", out)  # the view stays through a new export, and is no sample
    assert view.exists() and _samples("specforge", out) == [f"data_{i}.ckpt" for i in range(4)]


@pytest.fixture
def cli_export(tmp_path, monkeypatch):
    """`eagle3 export-shards` on a profile whose hidden-state version is a folder of this test's."""
    from eagle3_dagster import storage
    from eagle3_dagster.cli import main

    raw = yaml.safe_load((ROOT / "configs" / "micro.yaml").read_text())
    raw["run_root"], raw["hidden"]["root"] = str(tmp_path / "run"), str(tmp_path / "hidden")
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(raw))
    target = _weights_target(tmp_path / "target", 0)
    version_dir = _version(tmp_path / "hidden" / "hs-0123456789ab", 24)
    plan = types.SimpleNamespace(
        version="hs-0123456789ab", version_dir=storage.location(version_dir), target=types.SimpleNamespace(path=target)
    )
    monkeypatch.setattr("eagle3_dagster.hidden.extraction_plan.build_plan", lambda profile, layout: plan)
    return lambda *args: main(["--profile", str(tmp_path / "profile.yaml"), "export-shards", *args]), version_dir


def test_eagle3_export_shards_fails_its_check_on_a_corrupt_shard_and_refuses_a_foreign_folder(
    cli_export, tmp_path, capsys
):
    run, version_dir = cli_export
    assert run("--format", "specforge", "--out", str(tmp_path / "sf")) == 0
    assert len(_samples("specforge", tmp_path / "sf")) == 24 and (tmp_path / "sf" / "target_model").is_dir()
    assert run("--format", "specforge", "--out", str(tmp_path / "sf")) == 0  # its own earlier export
    capsys.readouterr()

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "data.csv").write_text("a,b\n")
    assert run("--format", "speculators", "--out", str(tmp_path / "mine")) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the progress bar's lines
    assert last.startswith("eagle3 export-shards: ") and "not an earlier export" in last and "Traceback" not in err

    _corrupt(version_dir, "shard-00000")
    assert run("--format", "speculators", "--out", str(tmp_path / "spec")) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("eagle3 export-shards: ") and "shard-00000" in last and "sha256" in last
    assert "Traceback" not in err
    assert not (tmp_path / "spec").exists()


def test_the_final_norm_for_speculators_is_read_only_from_inside_the_target(tmp_path):
    """Before, a sharded target's index naming `../elsewhere/x.safetensors` was followed to read the norm."""
    from eagle3_dagster.hidden.export_formats import load_final_norm_weight

    elsewhere = _weights_target(tmp_path / "elsewhere", 5)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text((elsewhere / "config.json").read_text())
    (target / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"model.norm.weight": "../elsewhere/model.safetensors"}})
    )
    with pytest.raises(ValueError, match=r"weight_map\['model.norm.weight'\]: file name '../elsewhere/"):
        load_final_norm_weight(target)
