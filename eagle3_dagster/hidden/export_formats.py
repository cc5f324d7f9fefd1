"""Exports of a hidden-state version to the per-sample layouts other trainers read.

Shards stay the primary format; these exist so a version can be handed to
SpecForge or speculators unchanged. Layouts as their readers expect them
(checked against their code):

SpecForge (`scripts/prepare_hidden_states.py`, offline EAGLE-3 reader):
    rows_{k*G}-{(k+1)*G}/data_{i}.ckpt, a torch.save dict per sample:
    input_ids [T] int64, loss_mask [T] int64, hidden_state [1, T, H] (post-norm,
    like ours), aux_hidden_state [1, T, 3H]. SpecForge 0.2.0 reads them unchanged
    (`runtime/data_plane/offline_reader.py`, `algorithms/eagle3/data.py`) and feeds
    `hidden_state` to `TargetHead`, which it always moves to bfloat16
    (`modeling/target/target_head.py`), and `aux_hidden_state` to the draft, built
    in the training dtype (bfloat16 by default): features of a float32 target fail
    there with "expected m1 and m2 to have the same dtype", so both are written in
    bfloat16 unless asked otherwise. `TargetHead.load_weights` also globs
    `*.index.json` beside the target weights and refuses a target without one;
    `specforge_target_dir` gives a target that lacks it a folder of links plus a
    generated `model.safetensors.index.json` (the target itself is never written to:
    its identity hashes the index).

speculators (`speculators.train.data.ArrowDataset`):
    an Arrow dataset (`datasets.save_to_disk`) with input_ids, loss_mask, seq_len,
    torch-formatted, and hidden_states/hs_{i}.safetensors with token_ids [T]
    int64 and hidden_states [T, 4, H] (3 aux + last). speculators recomputes
    teacher logits as lm_head(verifier_norm(last)), i.e. it expects the last
    state *before* the final RMSNorm; our shards hold it after. RMSNorm output y
    = w * x / rms(x) has y / w = x / rms(x), whose rms is 1, so norm(y / w) = y
    up to eps: exporting y / w (w = the target's final norm weight) makes
    speculators' teacher equal ours.

Both read the shards only after each has passed its checksum against its manifest
(`shards.verify_shard`, the check training makes): a shard training refuses is not
handed to another trainer either. Both write only into an empty folder or an earlier
export of this project (its `eagle3_export.json` marker, written before the first
sample), whose samples are removed first: SpecForge reads every `.ckpt` below the
folder, so 24 new samples beside 25 old ones would train on 25.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_save

from eagle3_dagster import storage
from eagle3_dagster.hidden.dataset import HiddenStatesDataset
from eagle3_dagster.hidden.shards import ShardCorruptError, load_manifest, shard_path, verify_shard
from eagle3_dagster.io import atomic_open, atomic_write_bytes, atomic_write_json
from eagle3_dagster.safetensors_folder import weight_files

EXPORT_MARKER = "eagle3_export.json"
EXPORT_FORMAT = "eagle3-dagster-hidden-export"
TARGET_VIEW = "target_model"  # specforge_target_dir's folder of links, rebuilt by each call
_GENERATED_BY = "eagle3 export-shards --format specforge"
# What an export writes beside its marker, by top-level name: files, and folders with the files allowed in
# them (atomic_open's temp files, `.NAME.HOST-PID.XXXX.tmp`, are what a killed export leaves). A new export
# removes them; anything else in the folder is someone else's, and the folder is refused.
_TEMP = r"\..+\.tmp"
_EXPORT_FILES = re.compile(
    rf"{re.escape(EXPORT_MARKER)}|data-\d{{5}}-of-\d{{5}}\.arrow|dataset_info\.json|"
    rf"state\.json|{_TEMP}"
)
_EXPORT_FOLDERS = (
    (re.compile(r"rows_\d+-\d+"), re.compile(rf"data_\d+\.ckpt|{_TEMP}")),  # specforge
    (re.compile(r"hidden_states"), re.compile(rf"hs_\d+\.safetensors|{_TEMP}")),
)  # speculators


class ExportFolderError(FileExistsError):
    """An export's output folder that holds files other than this project's earlier export."""


def verify_version(version_dir: storage.Location | Path | str) -> list[str]:
    """The keys of the version's complete shards, each checked against its manifest entry (size and sha256,
    `shards.verify_shard`, as training checks them) before anything is exported; a `ShardCorruptError` naming
    every shard that fails."""
    manifest = load_manifest(storage.location(version_dir))
    problems = []
    for key in sorted(manifest):
        try:
            verify_shard(shard_path(storage.location(version_dir), key), manifest[key])
        except ShardCorruptError as e:
            problems.append(str(e))
    if problems:
        raise ShardCorruptError(
            f"{version_dir}: {len(problems)} of {len(manifest)} shards do not match their manifest, so nothing is "
            "exported (training refuses them too); materialize those hidden_states partitions again: "
            + "; ".join(problems)
        )
    return sorted(manifest)


def _is_marker(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    try:
        marker = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(marker, dict) and marker.get("layout") in ("specforge", "speculators")


def _is_target_view(path: Path) -> bool:
    """A `specforge_target_dir` folder: links and the index it generated, nothing else."""
    index = path / "model.safetensors.index.json"
    if path.name != TARGET_VIEW or path.is_symlink() or not path.is_dir() or index.is_symlink() or not index.is_file():
        return False
    try:
        generated = json.loads(index.read_bytes()).get("metadata", {}).get("generated_by")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False
    return generated == _GENERATED_BY and all(
        p == index or p.is_symlink() or re.fullmatch(_TEMP, p.name) for p in path.iterdir()
    )


def _is_export_entry(path: Path) -> bool:
    if path.is_symlink():
        return False
    if path.is_file():
        return bool(_EXPORT_FILES.fullmatch(path.name))
    for folder, files in _EXPORT_FOLDERS:
        if path.is_dir() and folder.fullmatch(path.name):
            return all((p.is_file() or p.is_symlink()) and files.fullmatch(p.name) for p in path.iterdir())
    return False


def prepare_export_dir(out_dir: Path, layout: str) -> list[str]:
    """Make `out_dir` ready for an export and mark it as one (`EXPORT_MARKER`, before the first sample).

    It must be missing, empty, or an earlier export of this project (its marker; a `target_model` view of
    `specforge_target_dir` may be there too, and stays): the earlier export's files are removed, so no stale
    sample stays beside the new ones. Anything else is an `ExportFolderError`, raised before anything is
    removed. Returns the names removed."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportFolderError(f"{out_dir}: exists and is not a folder; export into an empty or new folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = [p for p in sorted(out_dir.iterdir()) if not _is_target_view(p)]
    if entries and not _is_marker(out_dir / EXPORT_MARKER):
        raise ExportFolderError(
            f"{out_dir}: not empty ({', '.join(p.name for p in entries[:5])}{', …' if len(entries) > 5 else ''}) and "
            f"not an earlier export of this project (no {EXPORT_MARKER}); export into an empty or new folder"
        )
    if foreign := [p.name for p in entries if not _is_export_entry(p)]:
        raise ExportFolderError(
            f"{out_dir}: an earlier export, but it also holds {foreign[:5]}, which no export writes; move them "
            "away (the trainers read every sample file below the folder)"
        )
    for p in entries:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    atomic_write_json(out_dir / EXPORT_MARKER, {"format": EXPORT_FORMAT, "layout": layout, "complete": False})
    return [p.name for p in entries]


SPECFORGE_FILE_GROUP_SIZE = 2000  # SpecForge's default --file-group-size


def specforge_path(out_dir: Path, index: int, group_size: int = SPECFORGE_FILE_GROUP_SIZE) -> Path:
    k = index // group_size
    return Path(out_dir) / f"rows_{k * group_size}-{(k + 1) * group_size}" / f"data_{index}.ckpt"


# What SpecForge's TargetHead and (by default) its draft model compute in.
SPECFORGE_DTYPE = torch.bfloat16


def export_specforge(
    version_dir: storage.Location | Path,
    out_dir: Path,
    *,
    group_size: int = SPECFORGE_FILE_GROUP_SIZE,
    progress: Callable[[int, int], None] | None = None,
    dtype: torch.dtype = SPECFORGE_DTYPE,
) -> int:
    """One torch.save file per sample, numbered in dataset order, states in `dtype`, into an empty folder or an
    earlier export (`prepare_export_dir`), from shards that pass their checksum; returns how many."""
    ds = HiddenStatesDataset(version_dir, verify_version(version_dir))
    prepare_export_dir(out_dir, "specforge")
    for i in range(len(ds)):
        s = ds[i]
        with atomic_open(specforge_path(out_dir, i, group_size)) as f:
            torch.save(
                {
                    "input_ids": s["input_ids"].clone(),
                    "loss_mask": s["loss_mask"].clone(),
                    "hidden_state": s["last_hidden"].to(dtype).unsqueeze(0).clone(),
                    "aux_hidden_state": s["aux_hidden"].to(dtype).unsqueeze(0).clone(),
                },
                f,
            )
        if progress is not None:
            progress(i + 1, len(ds))
    _write_provenance(out_dir, ds, "specforge", {"feature_dtype": str(dtype).removeprefix("torch.")})
    return len(ds)


def specforge_target_dir(target_dir: Path, out_dir: Path) -> Path:
    """A target folder SpecForge's TargetHead loads: the target itself when it has a `*.index.json`,
    else `out_dir/target_model` with a link to each of its files and a generated safetensors index."""
    from safetensors import safe_open

    target_dir = Path(target_dir).resolve()
    if list(target_dir.glob("*.index.json")):
        return target_dir
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{target_dir}: no *.safetensors weights to index for SpecForge")
    view = Path(out_dir) / TARGET_VIEW
    if view.exists() and not _is_target_view(view):
        raise ExportFolderError(f"{view}: exists and is not a target view this export wrote; move it away")
    view.mkdir(parents=True, exist_ok=True)
    for link in view.iterdir():  # rebuilt whole: a link of an earlier target must not stay beside the new index
        link.unlink()
    for f in target_dir.iterdir():
        if f.is_file():
            (view / f.name).symlink_to(f)
    weight_map, total = {}, 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                weight_map[name] = f.name
                sl = h.get_slice(name)
                numel = 1
                for d in sl.get_shape():
                    numel *= d
                total += numel * _DTYPE_BYTES[sl.get_dtype()]
    atomic_write_json(
        view / "model.safetensors.index.json",
        {"metadata": {"total_size": total, "generated_by": _GENERATED_BY}, "weight_map": weight_map},
    )
    return view


_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def load_final_norm_weight(model_dir: Path) -> torch.Tensor:
    """`model.norm.weight` of an HF checkpoint directory (single file or sharded with an index)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    name = "model.norm.weight"
    # a checkpoint from a hub: its index names files in its folder, which may be links (a hub cache snapshot)
    file = weight_files(model_dir, links_out=True).get(name)
    if file is None:
        raise KeyError(f"{model_dir}: no {name} in its safetensors weights")
    with safe_open(str(file), framework="pt") as f:
        if name not in f.keys():
            raise KeyError(f"{file}: no tensor {name}")
        return f.get_tensor(name)


def pre_norm_equivalent(last_hidden: torch.Tensor, final_norm_weight: torch.Tensor) -> torch.Tensor:
    """y / w in float32, cast back: a state whose RMSNorm (with weight w) is y again."""
    w = final_norm_weight.float()
    if bool((w == 0).any()):
        raise ValueError(
            f"final norm weight has zeros at {torch.nonzero(w == 0).flatten()[:5].tolist()}; "
            "the post-norm state cannot be mapped back for speculators"
        )
    return (last_hidden.float() / w).to(last_hidden.dtype)


def export_speculators(
    version_dir: storage.Location | Path,
    out_dir: Path,
    *,
    final_norm_weight: torch.Tensor,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Arrow dataset + hidden_states/hs_{i}.safetensors, into an empty folder or an earlier export
    (`prepare_export_dir`), from shards that pass their checksum; returns how many samples were written."""
    from datasets import Dataset

    ds = HiddenStatesDataset(version_dir, verify_version(version_dir))
    h = ds.metadata["hidden_size"]
    if tuple(final_norm_weight.shape) != (h,):
        raise ValueError(f"final_norm_weight has shape {tuple(final_norm_weight.shape)}, shards have hidden {h}")
    out_dir = Path(out_dir)
    prepare_export_dir(out_dir, "speculators")
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i in range(len(ds)):
        s = ds[i]
        states = torch.cat([s["aux_hidden"], pre_norm_equivalent(s["last_hidden"], final_norm_weight)], dim=-1)
        payload = {"token_ids": s["input_ids"].clone(), "hidden_states": states.reshape(-1, 4, h).contiguous()}
        atomic_write_bytes(out_dir / "hidden_states" / f"hs_{i}.safetensors", safetensors_save(payload))
        rows["input_ids"].append(s["input_ids"].tolist())
        rows["loss_mask"].append(s["loss_mask"].tolist())
        rows["seq_len"].append(len(s["input_ids"]))
        if progress is not None:
            progress(i + 1, len(ds))
    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(out_dir))
    _write_provenance(out_dir, ds, "speculators")
    return len(ds)


def _write_provenance(out_dir: Path, ds: HiddenStatesDataset, layout: str, extra: dict | None = None) -> None:
    atomic_write_json(
        Path(out_dir) / EXPORT_MARKER,
        {
            "format": EXPORT_FORMAT,
            "layout": layout,
            "complete": True,
            "num_samples": len(ds),
            "sample_ids": ds.sample_ids,
            **ds.metadata,
            "last_hidden": "pre-norm equivalent (y / final_norm.weight)" if layout == "speculators" else "post-norm",
            **(extra or {}),
        },
    )
