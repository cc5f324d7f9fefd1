"""Hidden-state shards: the file format, the writer, the per-shard manifests and the checksum check.

A shard is one safetensors file holding many samples row-concatenated:

    aux_hidden  [T, 3H] target dtype   the 3 aux layers (canonical numbering), concatenated in that order
    last_hidden [T, H]  target dtype   final hidden *after* the final norm (lm_head of it = logits)
    input_ids   [T]     int64
    offsets     [N+1]   int64          sample i is rows offsets[i]:offsets[i+1]
    loss_mask   [T]     uint8

With `dtype: float8_e4m3fn` the two states are stored in fp8 with one float32 scale
per token row of each state (`aux_scale [T, 3]`, one per aux layer, and
`last_scale [T]`, amax / 448), first in the file; a reader gets bfloat16 back
(`dataset.dequantize`). That is about half the bytes of bf16, and the layout below
predicts them exactly like any other dtype.

Header metadata (str -> str) records the target identity, aux layers and their
numbering, dtype, hidden size, code and format version and the sample ids.

We write the safetensors bytes ourselves instead of calling `safetensors.save`:
the library serialises `metadata` from a hash map (key order, hence bytes, differ
run to run) and needs every tensor in memory at once. Here the header is sorted
JSON (same inputs -> same bytes, which `plan` relies on to predict sizes
exactly) and rows are `pwrite`n at their final offsets as batches finish, so a
shard of any size is written with one batch of memory. Files are read with the
safetensors library itself (`dataset.HiddenStatesDataset`), which validates the format.

Commit protocol: a shard is written to `.{key}.safetensors.{host}-{pid}.tmp`, fsynced,
renamed, and only then its manifest `{key}.manifest.json` is written (atomic).
Resume trusts manifests, never file existence. One manifest per shard means
partition runs can finish in any order, concurrently, without a shared file.

A version folder is a `storage.Location`: a local folder or a prefix on an object
store. The writer always writes a local folder (the version's staging folder, which
for a local version is the version folder itself); `extract.publish_shard` publishes
a committed shard. Everything that reads (manifests, completeness, checksums,
`dataset.HiddenStatesDataset`) takes any location and never asks which kind it is.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from eagle3_dagster import storage
from eagle3_dagster.io import atomic_write_json, json_bytes, parse_json, remove_stale_temps, sha256_file, writer_tag
from eagle3_dagster.layers import CANONICAL_NUMBERING

if TYPE_CHECKING:
    import torch

SHARD_FORMAT = "eagle3-hidden-states"
SHARD_FORMAT_VERSION = 1
MANIFEST_SUFFIX = ".manifest.json"

# name (torch's too) -> (safetensors dtype tag, bytes per element). torch is imported only where tensors are
# handled (the writer's methods, `quantize_rows`; the reader is `dataset.HiddenStatesDataset`): a process that
# only reads manifests, sizes and checksums (a hidden_states step around a driver on another host) does not
# pay torch's import (~2 s of CPU).
DTYPES: dict[str, tuple[str, int]] = {
    "float32": ("F32", 4),
    "bfloat16": ("BF16", 2),
    "float16": ("F16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1),
}
SCALED_DTYPES = {"float8_e4m3fn"}  # stored with per-row scales
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_rows(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 values and float32 scales [T, groups] (one per row of each of the `groups` equal column blocks)."""
    import torch

    t = x.detach().to("cpu", torch.float32)
    blocks = t.view(t.shape[0], groups, -1)
    scale = (blocks.abs().amax(dim=-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(t.shape), scale


@dataclass(frozen=True)
class ShardFormat:
    """Everything besides the samples that determines a shard's bytes."""

    hidden_size: int
    dtype: str
    aux_layers: tuple[int, ...]
    target_identity: str
    code_version: str  # the backend's code version, e.g. "hf-1"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"hidden.dtype: {self.dtype!r} is not one of {sorted(DTYPES)}")
        if len(self.aux_layers) != 3:
            raise ValueError(f"hidden.aux_layers: EAGLE-3 needs 3 aux layers, got {list(self.aux_layers)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def scaled(self) -> bool:
        return self.dtype in SCALED_DTYPES


def shard_path(version_dir: storage.Location | Path, key: str) -> storage.Location:
    return storage.location(version_dir).join(f"{key}.safetensors")


def manifest_path(version_dir: storage.Location | Path, key: str) -> storage.Location:
    return storage.location(version_dir).join(f"{key}{MANIFEST_SUFFIX}")


def header_metadata(fmt: ShardFormat, key: str, sample_ids: Sequence[str], num_tokens: int) -> dict[str, str]:
    return {
        "aux_layer_numbering": CANONICAL_NUMBERING,
        "aux_layers": orjson.dumps(list(fmt.aux_layers)).decode(),
        "code_version": fmt.code_version,
        "dtype": fmt.dtype,
        "format": SHARD_FORMAT,
        "format_version": str(SHARD_FORMAT_VERSION),
        "hidden_size": str(fmt.hidden_size),
        "last_hidden_post_norm": "true",
        "num_samples": str(len(sample_ids)),
        "num_tokens": str(num_tokens),
        "sample_ids": orjson.dumps(list(sample_ids)).decode(),
        "shard_key": key,
        "target_identity": fmt.target_identity,
    }


def tensor_layout(fmt: ShardFormat, num_tokens: int, num_samples: int) -> list[tuple[str, str, list[int], int]]:
    """(name, safetensors dtype, shape, nbytes) in file order; float tensors first keeps them 8-byte aligned."""
    h, tag, size = fmt.hidden_size, DTYPES[fmt.dtype][0], fmt.itemsize
    scales = [
        ("aux_scale", "F32", [num_tokens, 3], num_tokens * 12),
        ("last_scale", "F32", [num_tokens], num_tokens * 4),
    ]
    return [
        *(scales if fmt.scaled else []),
        ("aux_hidden", tag, [num_tokens, 3 * h], num_tokens * 3 * h * size),
        ("last_hidden", tag, [num_tokens, h], num_tokens * h * size),
        ("input_ids", "I64", [num_tokens], num_tokens * 8),
        ("offsets", "I64", [num_samples + 1], (num_samples + 1) * 8),
        ("loss_mask", "U8", [num_tokens], num_tokens),
    ]


def encode_header(
    fmt: ShardFormat, key: str, sample_ids: Sequence[str], num_tokens: int
) -> tuple[bytes, dict[str, int], int]:
    """The file prefix (8-byte length + JSON padded with spaces to 8 bytes), each tensor's data offset, data size."""
    header: dict[str, object] = {"__metadata__": header_metadata(fmt, key, sample_ids, num_tokens)}
    starts: dict[str, int] = {}
    pos = 0
    for name, tag, shape, nbytes in tensor_layout(fmt, num_tokens, len(sample_ids)):
        header[name] = {"dtype": tag, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        starts[name] = pos
        pos += nbytes
    blob = orjson.dumps(header, option=orjson.OPT_SORT_KEYS)
    blob += b" " * (-len(blob) % 8)  # safetensors pads the header with spaces to an 8-byte boundary
    return struct.pack("<Q", len(blob)) + blob, starts, pos


def shard_file_size(fmt: ShardFormat, key: str, sample_ids: Sequence[str], lengths: Sequence[int]) -> int:
    prefix, _, data = encode_header(fmt, key, sample_ids, sum(lengths))
    return len(prefix) + data


def manifest_entry(
    fmt: ShardFormat,
    key: str,
    sample_ids: Sequence[str],
    lengths: Sequence[int],
    *,
    first_record: int,
    sha256: str,
    num_bytes: int,
) -> dict:
    rows, pos = [], 0
    for sid, n in zip(sample_ids, lengths, strict=True):
        rows.append({"id": sid, "rows": [pos, pos + n]})
        pos += n
    return {
        "bytes": num_bytes,
        "dtype": fmt.dtype,
        "file": shard_path(Path("."), key).name,
        "first_record": first_record,
        "format_version": SHARD_FORMAT_VERSION,
        "hidden_size": fmt.hidden_size,
        "num_samples": len(sample_ids),
        "num_tokens": pos,
        "samples": rows,
        "sha256": sha256,
        "shard": key,
    }


def manifest_bytes(entry: dict) -> bytes:
    """Exactly what `atomic_write_json` writes, so the plan can predict manifest sizes."""
    return json_bytes(entry)


class ShardWriter:
    """Assemble one shard from samples arriving in any order; `close()` commits it and writes its manifest.

    Usage (the hf backend and the SGLang dump assembler both do this):

        with ShardWriter(version_dir, spec.key, fmt, spec.sample_ids, spec.lengths,
                         first_record=spec.first_record) as w:
            for each sample: w.write_sample(sample_id, input_ids=..., loss_mask=..., aux_hidden=..., last_hidden=...)
        entry = w.entry          # the manifest entry, written after the rename

    Rows land at their final place in merged_train order whatever order samples
    come in, so the bytes depend only on the data. Leaving the `with` block on an
    exception deletes the temp file and commits nothing. One thread writes.
    """

    def __init__(
        self,
        version_dir: Path,
        key: str,
        fmt: ShardFormat,
        sample_ids: Sequence[str],
        lengths: Sequence[int],
        *,
        first_record: int = 0,
    ) -> None:
        if len(sample_ids) != len(lengths) or not sample_ids:
            raise ValueError(f"{key}: need one length per sample id and at least one sample")
        try:
            self.version_dir = storage.location(version_dir).local_path()
        except ValueError:
            raise ValueError(
                f"{key}: ShardWriter writes a local folder, not {version_dir}; shards for a store are "
                "written in the staging folder and published (extract.extract_shard does both)"
            ) from None
        self.key, self.fmt = key, fmt
        self.sample_ids, self.lengths, self.first_record = list(sample_ids), [int(n) for n in lengths], first_record
        self._index = {sid: i for i, sid in enumerate(self.sample_ids)}
        if len(self._index) != len(self.sample_ids):
            raise ValueError(f"{key}: duplicate sample ids")
        self._row0 = [0]
        for n in self.lengths:
            self._row0.append(self._row0[-1] + n)
        prefix, self._starts, data = encode_header(fmt, key, self.sample_ids, self._row0[-1])
        self._data_start = len(prefix)
        self.num_bytes = len(prefix) + data
        self.final_path = Path(shard_path(self.version_dir, key))
        self.version_dir.mkdir(parents=True, exist_ok=True)
        # a killed writer's temp on this host goes; another host's (a shared hidden.root) may be live and stays
        remove_stale_temps(self.final_path)
        # The shard is about to be replaced: an old manifest entry would vouch for the wrong bytes.
        with contextlib.suppress(FileNotFoundError):
            Path(manifest_path(self.version_dir, key)).unlink()
        self.tmp_path = self.version_dir / f".{self.final_path.name}.{writer_tag()}.tmp"  # ours, if abandoned: reused
        self._fd = os.open(self.tmp_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self._fd, self.num_bytes)
        os.pwrite(self._fd, prefix, 0)
        self._written: set[int] = set()
        self.entry: dict | None = None

    def _put(self, name: str, row: int, t: torch.Tensor) -> None:
        import torch

        width = t.element_size() * (t.shape[1] if t.dim() == 2 else 1)
        buf = t.contiguous().view(torch.uint8).numpy()
        os.pwrite(self._fd, buf.data.cast("B"), self._data_start + self._starts[name] + row * width)

    def write_sample(
        self,
        sample_id: str,
        *,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        aux_hidden: torch.Tensor,
        last_hidden: torch.Tensor,
    ) -> None:
        """Rows of one sample: aux_hidden [T, 3H] and last_hidden [T, H] (cast to the shard dtype), ids and mask [T]."""
        import torch

        i = self._index.get(sample_id)
        if i is None:
            raise KeyError(f"{self.key}: sample {sample_id!r} does not belong to this shard")
        if i in self._written:
            raise ValueError(f"{self.key}: sample {sample_id!r} written twice")
        n, h = self.lengths[i], self.fmt.hidden_size
        for name, t, shape in (
            ("input_ids", input_ids, (n,)),
            ("loss_mask", loss_mask, (n,)),
            ("aux_hidden", aux_hidden, (n, 3 * h)),
            ("last_hidden", last_hidden, (n, h)),
        ):
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{self.key}: sample {sample_id!r} {name} has shape {tuple(t.shape)}, expected {shape}"
                )
        row = self._row0[i]
        if self.fmt.scaled:
            (aux_q, aux_scale), (last_q, last_scale) = quantize_rows(aux_hidden, 3), quantize_rows(last_hidden, 1)
            self._put("aux_scale", row, aux_scale)
            self._put("last_scale", row, last_scale[:, 0])
            self._put("aux_hidden", row, aux_q)
            self._put("last_hidden", row, last_q)
        else:
            self._put("aux_hidden", row, aux_hidden.detach().to("cpu", self.fmt.torch_dtype))
            self._put("last_hidden", row, last_hidden.detach().to("cpu", self.fmt.torch_dtype))
        self._put("input_ids", row, input_ids.detach().to("cpu", torch.int64))
        self._put("loss_mask", row, loss_mask.detach().to("cpu", torch.uint8))
        self._written.add(i)

    def close(self) -> dict:
        """Check completeness, fsync, rename into place, then write the manifest entry; returns it."""
        missing = [self.sample_ids[i] for i in range(len(self.sample_ids)) if i not in self._written]
        if missing:
            raise ValueError(f"{self.key}: {len(missing)} samples never written, e.g. {missing[:3]}")
        import torch

        self._put("offsets", 0, torch.tensor(self._row0, dtype=torch.int64))
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        digest = sha256_file(self.tmp_path)
        os.replace(self.tmp_path, self.final_path)
        self.entry = manifest_entry(
            self.fmt,
            self.key,
            self.sample_ids,
            self.lengths,
            first_record=self.first_record,
            sha256=digest,
            num_bytes=self.num_bytes,
        )
        atomic_write_json(manifest_path(self.version_dir, self.key), self.entry)
        return self.entry

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            self.tmp_path.unlink()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class ShardCorruptError(RuntimeError):
    """A shard whose bytes differ from what its manifest recorded."""


def load_shard_manifest(version_dir: storage.Location | Path, key: str) -> dict | None:
    try:
        return storage.read_json(manifest_path(version_dir, key))
    except FileNotFoundError:
        return None


def load_manifest(version_dir: storage.Location) -> dict[str, dict]:
    """The version's manifest: shard key -> entry, aggregated from the per-shard files (sorted by key)."""
    version_dir = storage.location(version_dir)
    names = sorted(n for n in version_dir.file_sizes() if n.endswith(MANIFEST_SUFFIX) and not n.startswith("."))
    out: dict[str, dict] = {}
    for n, blob in zip(names, storage.read_many([version_dir.join(n) for n in names]), strict=True):
        try:
            entry = parse_json(blob, version_dir.join(n))
        except ValueError as e:
            raise ValueError(
                f"{e}: a corrupt shard manifest; delete it and the shard "
                f"{n[: -len(MANIFEST_SUFFIX)]} counts as missing and is extracted again"
            ) from None
        if entry.get("shard") != n[: -len(MANIFEST_SUFFIX)]:
            raise ValueError(
                f"{version_dir.join(n)}: manifest names shard {entry.get('shard')!r}, not its own file name"
            )
        out[entry["shard"]] = entry
    return out


def is_shard_complete(
    version_dir: storage.Location | Path, key: str, expected_ids: Sequence[str] | None = None
) -> bool:
    """Done = a manifest entry whose shard file has the recorded size (and, if given, the expected samples)."""
    entry = load_shard_manifest(version_dir, key)
    if entry is None or shard_path(version_dir, key).size() != entry["bytes"]:
        return False
    return expected_ids is None or [s["id"] for s in entry["samples"]] == list(expected_ids)


def verify_shard(path: storage.Location, manifest_entry: dict) -> None:
    """Recompute size and sha256 (on a store: read back in full); a mismatch is a `ShardCorruptError` naming
    the shard."""
    path = storage.location(path)
    size = path.size()
    if size is None:
        raise ShardCorruptError(f"shard {manifest_entry.get('shard')} ({path}): file is missing")
    if size != manifest_entry["bytes"]:
        raise ShardCorruptError(
            f"shard {manifest_entry['shard']} ({path}): {size} bytes on disk, manifest says {manifest_entry['bytes']}"
        )
    digest = path.sha256()
    if digest != manifest_entry["sha256"]:
        raise ShardCorruptError(
            f"shard {manifest_entry['shard']} ({path}): sha256 {digest} does not match the manifest's "
            f"{manifest_entry['sha256']}; the file is corrupted, delete it and its manifest to re-extract"
        )
