"""`fetch_export` reads a published `export_manifest.json` as foreign: its names stay in the destination.

Whoever can write the store can write the manifest. Before, its names were joined to the destination
unchecked: `../../x` and `/abs/path` entries (with the bytes and sha256 of a file the store also held)
were written outside the destination, and the fetch returned normally.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3_dagster.drafter.publish import EXPORT_MANIFEST, fetch_export, publish_export

V, H, DV = 40, 16, 10
PAYLOAD = b"written outside the destination\n"


@pytest.fixture
def published(tmp_path: Path) -> Path:
    """This project's drafter export, published to a local store folder `store/drafters/run-1`."""
    from eagle3_dagster.drafter.export import export_drafter
    from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter

    cfg = DrafterConfig(
        target_hidden_size=H,
        hidden_size=H,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        vocab_size=V,
        draft_vocab_size=DV,
        aux_layers=(2, 30, 58),
    )
    ids = torch.arange(0, V, V // DV)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    torch.manual_seed(0)
    export = export_drafter(
        Eagle3Drafter(cfg, torch.randn(V, H), ids - torch.arange(DV), t2d), tmp_path / "export", serving_context=4096
    )
    store = tmp_path / "store" / "drafters" / "run-1"
    publish_export(export, store, log=lambda _line: None)
    return store


def _with_entry(store: Path, name, entry=None) -> None:
    """The published manifest with one more file entry (by default: the payload's bytes and sha256)."""
    manifest = json.loads((store / EXPORT_MANIFEST).read_text())
    manifest["files"][name] = (
        entry if entry is not None else {"bytes": len(PAYLOAD), "sha256": hashlib.sha256(PAYLOAD).hexdigest()}
    )
    (store / EXPORT_MANIFEST).write_text(json.dumps(manifest))


def _files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_a_good_manifest_still_fetches(published, tmp_path):
    back = fetch_export(published, tmp_path / "dest" / "fetched")
    assert sorted(p.name for p in back.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize(
    "name, payload_at",
    [
        ("../../x", "store/x"),  # read from store/x, written to dest/x
        ("sub/../../../x", "store/x"),  # `..` in a middle component
        ("ABSOLUTE", None),  # an absolute path: read from and written to that very path
    ],
)
def test_a_manifest_name_leading_out_of_the_destination_writes_nothing(name, payload_at, published, tmp_path):
    absolute = tmp_path / "elsewhere" / "payload"
    absolute.parent.mkdir()
    absolute.write_bytes(PAYLOAD)
    name = str(absolute) if name == "ABSOLUTE" else name
    if payload_at:
        (tmp_path / payload_at).write_bytes(PAYLOAD)
    (published / "sub").mkdir()
    _with_entry(published, name)
    inode = absolute.stat().st_ino
    before = _files_under(tmp_path)
    dest = tmp_path / "dest" / "fetched"
    with pytest.raises(ValueError, match=rf"{EXPORT_MANIFEST}: files entry {name!r}.*refused") as e:
        fetch_export(published, dest)
    assert type(e.value).__name__ == "ForeignInputError" and "\n" not in str(e.value)
    assert _files_under(tmp_path) == before and absolute.stat().st_ino == inode  # nothing written anywhere
    assert not dest.exists() or not any(dest.iterdir())  # checked before the first file is fetched


@pytest.mark.parametrize("name", ["sub/config.json", EXPORT_MANIFEST, ".bashrc", "", "."])
def test_a_manifest_name_that_is_not_a_published_file_name_is_refused(name, published, tmp_path):
    _with_entry(published, name)
    with pytest.raises(ValueError, match=rf"files entry {name!r}") as e:
        fetch_export(published, tmp_path / "dest")
    assert type(e.value).__name__ == "ForeignInputError"
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").iterdir())


@pytest.mark.parametrize(
    "entry",
    [
        {"bytes": "33", "sha256": "0" * 64},
        {"bytes": True, "sha256": "0" * 64},
        {"bytes": -1, "sha256": "0" * 64},
        {"bytes": 33, "sha256": "../../x"},
        [33, "ab"],
    ],
)
def test_a_manifest_entry_that_is_not_bytes_and_sha256_is_refused(entry, published, tmp_path):
    _with_entry(published, "extra.json", entry)
    with pytest.raises(ValueError, match=r"files entry 'extra.json'.*bytes: a size, sha256") as e:
        fetch_export(published, tmp_path / "dest")
    assert type(e.value).__name__ == "ForeignInputError"


@pytest.mark.timeout(60)  # before: /dev/zero was downloaded without end
def test_a_published_file_that_is_a_device_is_refused_by_its_size_before_it_is_read(published, tmp_path):
    weights = published / "model.safetensors"
    weights.unlink()
    weights.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=r"model.safetensors: missing or not a file, the manifest says \d+ bytes"):
        fetch_export(published, tmp_path / "dest")


def test_a_destination_entry_linking_out_is_refused(published, tmp_path):
    """Stricter than needed (the atomic rename replaces a link rather than writing through it, before too): a
    destination holding a link out of itself is refused rather than half-replaced."""
    dest = tmp_path / "dest"
    dest.mkdir()
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (dest / "config.json").symlink_to(outside)
    with pytest.raises(ValueError, match=r"files entry 'config.json'.*through a symlink"):
        fetch_export(published, dest)
    assert outside.read_text() == "{}"


def test_confined_path_refuses_every_way_out(tmp_path):
    from eagle3_dagster.io import ForeignInputError, confined_path, regular_file

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("x")
    (tmp_path / "out").symlink_to(tmp_path.parent)
    assert confined_path(tmp_path, "a/f", where="w") == tmp_path / "a" / "f"
    assert confined_path(tmp_path, "./a/f", where="w") == tmp_path / "a" / "f"
    for name in ("../x", "/etc/passwd", "a/../../x", "a/../f", "out/x", "", ".", "a\0b", 7, None, ["a"]):
        with pytest.raises(ForeignInputError, match="w: "):
            confined_path(tmp_path, name, where="w")
    with pytest.raises(ForeignInputError, match="not a bare file name"):
        confined_path(tmp_path, "a/f", where="w", flat=True)
    assert regular_file(tmp_path / "a" / "f", where="w") == tmp_path / "a" / "f"
    with pytest.raises(ForeignInputError, match="is a folder"):
        regular_file(tmp_path / "a", where="w")
    (tmp_path / "rand").symlink_to("/dev/urandom")
    with pytest.raises(ForeignInputError, match=r"is a device \(/dev/urandom\)"):
        regular_file(tmp_path / "rand", where="w")
    with pytest.raises(FileNotFoundError, match="w: "):
        regular_file(tmp_path / "missing", where="w")
    save_file({"t": torch.ones(1)}, str(tmp_path / "a" / "t.safetensors"))  # a real file is a regular file
    assert regular_file(tmp_path / "a" / "t.safetensors", where="w").stat().st_size > 0
