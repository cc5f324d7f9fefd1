"""The hidden-state context of a profile, and extraction_plan's contract file that carries it.

`hidden_context` is the one computation that parses and hashes merged_train for
extraction (shard specs, version, format), and where the version's `storage.Location`
and the local folder its shards are written in are decided, once; `write_plan` stores it once in the
version folder (local or on the object store, like the shards) and `load_plan`
is how every later stage (shard runs, training, cleanup) gets it back. Keys and
the contract version are in `contracts.py`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_dagster import storage
from eagle3_dagster.config import Profile
from eagle3_dagster.contracts import BACKEND_CODE_VERSIONS, PLAN_CONTRACT, PLAN_CONTRACT_VERSION, ArtifactLayout
from eagle3_dagster.hidden.sharding import ShardSpec, hidden_version, plan_shards
from eagle3_dagster.hidden.shards import ShardFormat
from eagle3_dagster.io import sha256_file
from eagle3_dagster.target import TargetFacts, target_facts


@dataclass(frozen=True)
class HiddenContext:
    target: TargetFacts
    shards: list[ShardSpec]
    fmt: ShardFormat
    version: str
    version_dir: storage.Location  # a local folder or a prefix on an object store
    merged_train: Path
    merged_train_sha256: str = ""
    # the local folder shards are written in, one subfolder per version, before they are published to
    # version_dir: hidden.root itself when it is a local folder (publishing is then a no-op)
    staging_dir: Path | None = None

    def __post_init__(self) -> None:  # a Path or URL string given for version_dir is taken as its Location
        object.__setattr__(self, "version_dir", storage.location(self.version_dir))


def write_plan(ctx: HiddenContext) -> storage.Location:
    """extraction_plan's contract: everything later stages need, computed once."""
    path = ctx.version_dir.join(PLAN_CONTRACT)
    path.write_json({
        "contract_version": PLAN_CONTRACT_VERSION,
        "version": ctx.version,
        "version_dir": str(ctx.version_dir),
        "merged_train": str(ctx.merged_train),
        "merged_train_sha256": ctx.merged_train_sha256,
        "target": {**asdict(ctx.target), "path": str(ctx.target.path)},
        "format": asdict(ctx.fmt),
        "shards": [asdict(s) for s in ctx.shards],
        "staging_dir": None if ctx.staging_dir is None else str(ctx.staging_dir),
    })
    return path


def load_plan(path: storage.Location) -> HiddenContext:
    """The HiddenContext extraction_plan wrote; an error names the file when it is missing or foreign."""
    path = storage.location(path)
    try:
        raw = storage.read_json(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"extraction plan {path} not found; materialize extraction_plan first") from None
    if raw.get("contract_version") != PLAN_CONTRACT_VERSION:
        raise ValueError(f"{path}: plan contract version {raw.get('contract_version')!r}, this code reads "
                         f"{PLAN_CONTRACT_VERSION}; materialize extraction_plan again")
    t = raw["target"]
    target = TargetFacts(**{**t, "path": Path(t["path"]), "aux_layers": tuple(t["aux_layers"])})
    fmt = ShardFormat(**{**raw["format"], "aux_layers": tuple(raw["format"]["aux_layers"])})
    shards = [ShardSpec(**{**s, "sample_ids": tuple(s["sample_ids"]), "lengths": tuple(s["lengths"])})
              for s in raw["shards"]]
    version_dir = storage.location(raw["version_dir"])
    staging = raw.get("staging_dir")  # null in plans written before a local root named itself here
    return HiddenContext(target, shards, fmt, raw["version"], version_dir, Path(raw["merged_train"]),
                         raw["merged_train_sha256"],
                         version_dir.parent.local_folder(None if staging is None else Path(staging)))


def hidden_context(profile: Profile, layout: ArtifactLayout) -> HiddenContext:
    target = target_facts(profile, layout)
    merged = layout.merged_train
    if not merged.exists():
        raise FileNotFoundError(f"merged_train: {merged} not found; materialize merged_train first")
    shards = plan_shards(merged, profile.hidden.samples_per_shard,
                         max_seq_len=profile.data.max_seq_len, vocab_size=target.vocab_size)
    backend_version = BACKEND_CODE_VERSIONS[profile.hidden.backend]
    merged_sha = sha256_file(merged)
    version = hidden_version(
        target.identity, merged_sha, list(target.aux_layers), profile.hidden.dtype, backend_version,
        samples_per_shard=profile.hidden.samples_per_shard,
        batch_tokens=profile.hidden.batch_tokens if profile.hidden.backend == "hf" else None,
    )
    fmt = ShardFormat(
        hidden_size=target.hidden_size, dtype=profile.hidden.dtype, aux_layers=target.aux_layers,
        target_identity=target.identity, code_version=backend_version,
    )
    root = storage.location(layout.hidden_root)
    return HiddenContext(target, shards, fmt, version, root.join(version), merged, merged_sha,
                         root.local_folder(layout.staging_dir))
