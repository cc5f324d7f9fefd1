"""Hidden states of the target for every merged_train sample: shards, the hf backend, the extraction plan.

`sharding` decides which samples go in which shard and names the version;
`shards` owns the file format, writer, manifests and the training-time reader;
`extract_hf` is the transformers backend; `plan` predicts bytes and time and
cleans up superseded versions; `export_formats` writes SpecForge / speculators
layouts. The SGLang backend lives in its own package and reuses `ShardWriter`.
"""

from eagle3_dagster.hidden.shards import (
    HiddenStatesDataset,
    ShardCorruptError,
    ShardFormat,
    ShardWriter,
    is_shard_complete,
    load_manifest,
    verify_shard,
)
from eagle3_dagster.hidden.sharding import ShardSpec, hidden_version, plan_shards

__all__ = [
    "HiddenStatesDataset",
    "ShardCorruptError",
    "ShardFormat",
    "ShardSpec",
    "ShardWriter",
    "hidden_version",
    "is_shard_complete",
    "load_manifest",
    "plan_shards",
    "verify_shard",
]
