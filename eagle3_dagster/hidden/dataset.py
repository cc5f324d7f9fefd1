"""The training-time reader of hidden-state shards (the format, writer and manifests are `shards`).

`HiddenStatesDataset` reads any version location through `ranged.open_tensors`, the
one read path for a local folder (memory-mapped by safetensors) and an object store
(range requests); fp8 shards come back in bfloat16 (`dequantize`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import orjson
import torch

from eagle3_dagster import storage
from eagle3_dagster.hidden.ranged import open_tensors
from eagle3_dagster.hidden.shards import SCALED_DTYPES, SHARD_FORMAT, load_manifest, shard_path


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The states a reader gets back from an fp8 shard: values times their per-row scales, in `dtype`."""
    groups = 1 if scale.dim() == 1 else scale.shape[-1]
    blocks = q.to(torch.float32).view(q.shape[0], groups, -1) * scale.view(q.shape[0], groups, 1)
    return blocks.view(q.shape).to(dtype)


class HiddenStatesDataset(torch.utils.data.Dataset):
    """Per-sample random access over a version's shards, through `ranged.open_tensors`: memory-mapped by
    safetensors when the version is on this machine, range requests on an object store (each shard's header
    once per process, then one concurrent fetch of a sample's rows).

    Only complete shards (those with a manifest entry) are visible. Samples are
    ordered by shard key then merged_train order. File handles open lazily per
    process, so the dataset can be handed to DataLoader workers.
    """

    def __init__(self, version_dir: storage.Location | Path | str, shard_keys: Sequence[str] | None = None) -> None:
        self.version_dir = storage.location(version_dir)
        manifest = load_manifest(self.version_dir)
        keys = sorted(manifest) if shard_keys is None else list(shard_keys)
        missing = [k for k in keys if k not in manifest]
        if missing:
            raise FileNotFoundError(f"{self.version_dir}: no complete shard (manifest entry) for {missing[:5]}")
        if not keys:
            raise FileNotFoundError(f"{self.version_dir}: no complete shards")
        self._files = [shard_path(self.version_dir, k) for k in keys]
        self._sizes = [int(manifest[k]["bytes"]) for k in keys]
        self._rows: list[tuple[int, int, int, str]] = []
        for f, key in enumerate(keys):
            for s in manifest[key]["samples"]:
                self._rows.append((f, s["rows"][0], s["rows"][1], s["id"]))
        self._handles: dict[int, object] = {}
        self._pid = os.getpid()
        self.metadata = self._read_metadata(keys)

    def _read_metadata(self, keys: list[str]) -> dict:
        common = (
            "format",
            "format_version",
            "target_identity",
            "aux_layers",
            "aux_layer_numbering",
            "dtype",
            "hidden_size",
            "last_hidden_post_norm",
        )
        first: dict[str, str] | None = None
        for f_index, path in enumerate(self._files):
            meta = self._handle(f_index).metadata()
            if meta.get("format") != SHARD_FORMAT:
                raise ValueError(f"{path}: not an {SHARD_FORMAT} shard (header format={meta.get('format')!r})")
            if first is None:
                first = meta
            elif any(meta.get(k) != first.get(k) for k in common):
                diff = [k for k in common if meta.get(k) != first.get(k)]
                raise ValueError(f"{path}: header differs from {self._files[0].name} in {diff}")
        assert first is not None
        return {
            "format_version": int(first["format_version"]),
            "target_identity": first["target_identity"],
            "aux_layers": orjson.loads(first["aux_layers"]),
            "aux_layer_numbering": first["aux_layer_numbering"],
            "dtype": first["dtype"],
            "hidden_size": int(first["hidden_size"]),
            "last_hidden_post_norm": first["last_hidden_post_norm"] == "true",
            "code_version": first["code_version"],
        }

    def __len__(self) -> int:
        return len(self._rows)

    def lengths(self) -> list[int]:
        return [end - start for _, start, end, _ in self._rows]

    @property
    def sample_ids(self) -> list[str]:
        return [sid for *_, sid in self._rows]

    def _handle(self, f: int):
        if self._pid != os.getpid():  # forked into a worker: never share the parent's handles
            self._handles, self._pid = {}, os.getpid()
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = open_tensors(self._files[f], self._sizes[f])
        return h

    def __getitem__(self, i: int) -> dict:
        f, start, end, sid = self._rows[i]
        scaled = self.metadata["dtype"] in SCALED_DTYPES
        names = [
            "input_ids",
            "loss_mask",
            "aux_hidden",
            "last_hidden",
            *(["aux_scale", "last_scale"] if scaled else []),
        ]
        got = dict(zip(names, self._handle(f).rows([(n, start, end) for n in names]), strict=True))
        aux, last = got["aux_hidden"], got["last_hidden"]
        if scaled:
            aux, last = dequantize(aux, got["aux_scale"]), dequantize(last, got["last_scale"])
        return {
            "input_ids": got["input_ids"].long(),
            "loss_mask": got["loss_mask"].long(),
            "aux_hidden": aux,
            "last_hidden": last,
            "sample_id": sid,
        }

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state
