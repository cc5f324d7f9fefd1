"""The weights of a checkpoint folder someone else wrote (a drafter from another trainer, a target from a hub):
which file holds each tensor, from its `*.safetensors.index.json` or its `*.safetensors`, each file checked to
be a regular file inside the folder. The one reader of such an index: the drafter import, the target's embedding,
LM head and norm, and the final norm of the speculators export all read through it.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from eagle3_dagster.io import ForeignInputError, confined_path, regular_file


def weight_files(export_dir: Path, *, links_out: bool = False) -> dict[str, Path]:
    """Tensor name → file of a checkpoint folder (a drafter's, a target's): from its `*.safetensors.index.json`,
    else every `*.safetensors`.

    Each file must be a regular file inside the folder: an index naming `../x` or `/x`, or a weight that is a
    link out of the folder (or to a device), is a `ForeignInputError` naming it. `links_out`: for a target, the
    profile's own folder, which may be a hub cache snapshot (its files link to `../../blobs/`) or the links
    `eagle3 export-shards --format specforge` makes; a link must still lead to a regular file, and an index's
    names must still be relative names without `..`."""
    export_dir = Path(export_dir)
    if not list(export_dir.glob("*.safetensors")) and not list(export_dir.glob("*.safetensors.index.json")):
        found = sorted(p.name for p in export_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        raise FileNotFoundError(
            f"{export_dir}: no *.safetensors weights"
            + (f" (found {found}; re-export with safetensors)" if found else "")
        )
    indexes = sorted(export_dir.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise ForeignInputError(f"{export_dir}: several safetensors index files {[p.name for p in indexes]}")
    if indexes:
        index = regular_file(
            confined_path(export_dir, indexes[0].name, where=str(export_dir), links_out=links_out),
            where=str(indexes[0]),
        )
        try:
            weight_map = json.loads(index.read_bytes()).get("weight_map")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise ForeignInputError(f"{index}: not a safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ForeignInputError(f"{index}: weight_map is not an object of tensor name → file")
        files = {}
        for name, file in weight_map.items():
            where = f"{index} weight_map[{name!r}]"
            files[name] = regular_file(confined_path(export_dir, file, where=where, links_out=links_out), where=where)
        return files
    out: dict[str, Path] = {}
    for f in sorted(export_dir.glob("*.safetensors")):
        where = f"{export_dir}: weights {f.name}"
        path = regular_file(confined_path(export_dir, f.name, where=where, links_out=links_out), where=where)
        out.update({k: path for k in read_safetensors(path, lambda h: list(h.keys()))})
    return out


def read_safetensors(path: Path, read):
    """`read(handle)` on a safetensors file; a file safetensors cannot read is an error naming it."""
    try:
        with safe_open(str(path), framework="pt") as h:
            return read(h)
    except (SafetensorError, OSError) as e:
        raise ForeignInputError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
