"""Row slices of a safetensors file at any `storage.Location`: the storage layer's reader of shards.

`open_tensors` is the one way a shard's rows are read: a file on this machine is memory-mapped through
`safetensors.safe_open`, and one on an object store is read by HTTP range requests (`RangedSafetensors`);
both answer `metadata()` and `rows()`, so a reader (`dataset.HiddenStatesDataset`) has one read path.

An object store has no mmap, and a shard
is many samples, so downloading it per sample would move the whole shard for each one. This reader does
what the mmap does, over fsspec: the header is read once (its 8-byte length, then the JSON), and a
sample's rows of each tensor are one byte range, all ranges of a sample fetched in one concurrent call.

safetensors cannot read a file-like object or a byte range (its `safe_open` takes a local path only,
`load` takes the whole file's bytes), hence this small reader; it checks what `safe_open` checks for the
parts it reads: the header parses, every tensor's dtype is known and its byte span matches its shape and
lies inside the file, and the object's size is the one the manifest recorded.
"""

from __future__ import annotations

import struct

import orjson
import torch

from eagle3_dagster import storage

SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64,
    "U8": torch.uint8,
}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def open_tensors(loc: storage.Location, num_bytes: int) -> "MappedSafetensors | RangedSafetensors":
    """A reader of the safetensors file at `loc` (of `num_bytes`, as its manifest recorded)."""
    try:
        path = loc.local_path()
    except ValueError:  # on a store: no file to map
        return RangedSafetensors(loc, num_bytes)
    return MappedSafetensors(path)


class MappedSafetensors:
    """A local safetensors file, memory-mapped by the library itself (which validates the format)."""

    def __init__(self, path) -> None:
        from safetensors import safe_open

        self._f = safe_open(str(path), framework="pt")

    def metadata(self) -> dict[str, str]:
        return dict(self._f.metadata() or {})

    def rows(self, requests: list[tuple[str, int, int]]) -> list[torch.Tensor]:
        """`tensor[start:end]` for each (tensor name, start, end)."""
        return [self._f.get_slice(tname)[start:end] for tname, start, end in requests]


class RangedSafetensors:
    """Header and row ranges of one safetensors file at `loc` (local path or URL) of known size."""

    def __init__(self, loc: storage.Location | str, num_bytes: int) -> None:
        self.loc, self.num_bytes = storage.location(loc), int(num_bytes)
        loc = self.loc
        (length,) = struct.unpack("<Q", loc.read_ranges([(0, 8)])[0])
        if not 0 < length <= min(MAX_HEADER_BYTES, self.num_bytes - 8):
            raise ValueError(f"{loc}: not a safetensors file (header length {length}, file {self.num_bytes} bytes)")
        try:
            header = orjson.loads(loc.read_ranges([(8, 8 + length)])[0])
        except orjson.JSONDecodeError as e:
            raise ValueError(f"{loc}: safetensors header is not JSON ({e})") from None
        self._metadata: dict[str, str] = header.pop("__metadata__", {}) or {}
        self._data_start = 8 + length
        self._tensors: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
        for tname, info in header.items():
            dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
            start, end = info["data_offsets"]
            shape = [int(d) for d in info["shape"]]
            numel = 1
            for d in shape:
                numel *= d
            if dtype is None or end - start != numel * dtype.itemsize or self._data_start + end > self.num_bytes:
                raise ValueError(
                    f"{loc}: tensor {tname!r} ({info.get('dtype')}, shape {shape}, bytes "
                    f"[{start}, {end})) does not fit the file"
                )
            self._tensors[tname] = (dtype, shape, start, end)

    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def _row_range(self, tname: str, start: int, end: int) -> tuple[int, int]:
        dtype, shape, t0, _ = self._tensors[tname]
        width = dtype.itemsize * (shape[1] if len(shape) == 2 else 1)
        if not 0 <= start <= end <= shape[0]:
            raise IndexError(f"{self.loc}: rows [{start}, {end}) outside {tname} with {shape[0]} rows")
        return self._data_start + t0 + start * width, self._data_start + t0 + end * width

    def rows(self, requests: list[tuple[str, int, int]]) -> list[torch.Tensor]:
        """`tensor[start:end]` for each (tensor name, start, end), fetched together."""
        blobs = self.loc.read_ranges([self._row_range(*r) for r in requests])
        out = []
        for (tname, start, end), blob in zip(requests, blobs, strict=True):
            dtype, shape, _, _ = self._tensors[tname]
            if len(blob) != self._row_range(tname, start, end)[1] - self._row_range(tname, start, end)[0]:
                raise ValueError(f"{self.loc}: short read of {tname} rows [{start}, {end})")
            t = torch.frombuffer(bytearray(blob), dtype=dtype) if blob else torch.empty(0, dtype=dtype)
            out.append(t.view(end - start, *shape[1:]))
        return out
