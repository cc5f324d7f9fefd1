"""The extraction plan of a profile (`ExtractionPlan`), and the plan file (plan.json) that carries it.

`build_plan` is the one computation that parses and hashes merged_train for
extraction (shard specs, version, format), and where the version's `storage.Location`
and the local folder its shards are written in are decided, once; `write_plan` stores it once in the
version folder (local or on the object store, like the shards) and `load_plan`
is how every later stage (shard runs, training, cleanup) gets it back from its `plan_path`. The file's name,
metadata key and format version are in `contracts.py`. What extraction will cost (bytes, hours, free space)
is the estimate, in `hidden.estimate`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_dagster import storage
from eagle3_dagster.config import Profile
from eagle3_dagster.contracts import BACKEND_CODE_VERSIONS, PLAN_FILE, PLAN_FORMAT_VERSION, ArtifactLayout
from eagle3_dagster.hidden.sharding import ShardSpec, hidden_version, plan_shards
from eagle3_dagster.hidden.shards import ShardFormat
from eagle3_dagster.io import sha256_file
from eagle3_dagster.target import TargetFacts, target_facts


@dataclass(frozen=True)
class ExtractionPlan:
    """What extraction_plan decided for one hidden-state version: its shards, their format and where they go."""

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


def write_plan(plan: ExtractionPlan) -> storage.Location:
    """Store the plan as PLAN_FILE in its version folder, once: everything later stages need; returns its path."""
    path = plan.version_dir.join(PLAN_FILE)
    path.write_json(
        {
            "contract_version": PLAN_FORMAT_VERSION,  # the key plans already written carry
            "version": plan.version,
            "version_dir": str(plan.version_dir),
            "merged_train": str(plan.merged_train),
            "merged_train_sha256": plan.merged_train_sha256,
            "target": {**asdict(plan.target), "path": str(plan.target.path)},
            "format": asdict(plan.fmt),
            "shards": [asdict(s) for s in plan.shards],
            "staging_dir": None if plan.staging_dir is None else str(plan.staging_dir),
        }
    )
    return path


def load_plan(plan_path: storage.Location | Path | str) -> ExtractionPlan:
    """The ExtractionPlan extraction_plan wrote; an error names the file when it is missing or foreign."""
    path = storage.location(plan_path)
    try:
        raw = storage.read_json(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"extraction plan {path} not found; materialize extraction_plan first") from None
    if raw.get("contract_version") != PLAN_FORMAT_VERSION:
        raise ValueError(
            f"{path}: plan format version {raw.get('contract_version')!r}, this code reads "
            f"{PLAN_FORMAT_VERSION}; materialize extraction_plan again"
        )
    t = raw["target"]
    target = TargetFacts(**{**t, "path": Path(t["path"]), "aux_layers": tuple(t["aux_layers"])})
    fmt = ShardFormat(**{**raw["format"], "aux_layers": tuple(raw["format"]["aux_layers"])})
    shards = [
        ShardSpec(**{**s, "sample_ids": tuple(s["sample_ids"]), "lengths": tuple(s["lengths"])}) for s in raw["shards"]
    ]
    version_dir = storage.location(raw["version_dir"])
    staging = raw.get("staging_dir")  # null in plans written before a local root named itself here
    return ExtractionPlan(
        target,
        shards,
        fmt,
        raw["version"],
        version_dir,
        Path(raw["merged_train"]),
        raw["merged_train_sha256"],
        version_dir.parent.local_folder(None if staging is None else Path(staging)),
    )


def build_plan(profile: Profile, layout: ArtifactLayout) -> ExtractionPlan:
    """Cut merged_train into shards and name the hidden-state version: the plan extraction_plan writes."""
    h = profile.hidden
    return plan_for(
        target_facts(profile, layout),
        layout,
        samples_per_shard=h.samples_per_shard,
        max_seq_len=profile.data.max_seq_len,
        backend=h.backend,
        dtype=h.dtype,
        batch_tokens=h.batch_tokens,
    )


def plan_for(
    target: TargetFacts,
    layout: ArtifactLayout,
    *,
    samples_per_shard: int,
    max_seq_len: int,
    backend: str,
    dtype: str,
    batch_tokens: int,
) -> ExtractionPlan:
    """`build_plan` from the settings themselves (hidden.*, data.max_seq_len), as the plan stage is given them."""
    merged = layout.merged_train
    if not merged.exists():
        raise FileNotFoundError(f"merged_train: {merged} not found; materialize merged_train first")
    shards = plan_shards(merged, samples_per_shard, max_seq_len=max_seq_len, vocab_size=target.vocab_size)
    backend_version = BACKEND_CODE_VERSIONS[backend]
    merged_sha = sha256_file(merged)
    version = hidden_version(
        target.identity,
        merged_sha,
        list(target.aux_layers),
        dtype,
        backend_version,
        samples_per_shard=samples_per_shard,
        batch_tokens=batch_tokens if backend == "hf" else None,
    )
    fmt = ShardFormat(
        hidden_size=target.hidden_size,
        dtype=dtype,
        aux_layers=target.aux_layers,
        target_identity=target.identity,
        code_version=backend_version,
    )
    root = storage.location(layout.hidden_root)
    return ExtractionPlan(
        target, shards, fmt, version, root.join(version), merged, merged_sha, root.local_folder(layout.staging_dir)
    )
