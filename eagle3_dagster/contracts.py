"""Where each stage's artifact lives, the records passed between stages, and the versions of their formats.

Stages never guess paths from the file system: the asset layer builds an
`ArtifactLayout` from the profile and hands each engine function the explicit
upstream paths it needs. The extraction plan (plan.json) carries `PLAN_FORMAT_VERSION`; a
shard carries the backend code version below (and `hidden.shards.SHARD_FORMAT_VERSION`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eagle3_dagster.storage import Location

# Shard-format code versions, one per extraction backend. Each is written into every shard header and is part
# of the hidden-state version, so the plan's byte prediction and the shards agree; the SGLang driver is handed
# the plan's value on its command line rather than naming its own.
HF_BACKEND_CODE_VERSION = "hf-1"
SGLANG_BACKEND_CODE_VERSION = "sglang-1"
BACKEND_CODE_VERSIONS = {"hf": HF_BACKEND_CODE_VERSION, "sglang": SGLANG_BACKEND_CODE_VERSION}

# The extraction plan (`hidden.extraction_plan.ExtractionPlan`), extraction_plan's output, written once as
# PLAN_FILE into the version folder it plans: the version, the shard specs, the shard format (code version
# included) and the inputs it was computed from. hidden_states partitions, training and cleanup read it (its
# path is extraction_plan's materialization metadata under PLAN_PATH_KEY) instead of re-parsing and re-hashing
# merged_train. The file records PLAN_FORMAT_VERSION under its key "contract_version", kept so that plans
# already written still load.
PLAN_FILE = "plan.json"
PLAN_PATH_KEY = "plan_path"
PLAN_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Conversation:
    """A prompt conversation as the data readers yield it (ShareGPT, prompts and conversations files), the
    generation stage answers it and the tokenize stage renders it."""

    id: str
    messages: tuple[dict, ...]  # {"role": "system"|"user"|"assistant", "content": str}


@dataclass(frozen=True)
class ArtifactLayout:
    """Paths of every artifact under one profile's run root (and the hidden-states root).

    `hidden_root` is a `storage.Location` (a local path or an object-store URL; a `Path` is taken as one);
    `hidden_staging` is the local folder shards are written in before upload (default under run_root)."""

    run_root: Path
    hidden_root: "Location | Path"
    hidden_staging: Path | None = None

    @property
    def staging_dir(self) -> Path:
        return self.hidden_staging if self.hidden_staging is not None else self.run_root / "hidden_staging"

    @property
    def target_dir(self) -> Path:
        return self.run_root / "target"

    def raw_responses(self, dataset: str) -> Path:
        return self.run_root / "raw_responses" / f"{dataset}.jsonl"

    def tokenized_dir(self, dataset: str) -> Path:
        return self.run_root / "tokenized" / dataset

    def tokenized(self, dataset: str) -> Path:
        return self.tokenized_dir(dataset) / "tokenized_data.jsonl"

    def quarantine(self, dataset: str) -> Path:
        return self.tokenized_dir(dataset) / "quarantine.jsonl"

    @property
    def merged_train(self) -> Path:
        return self.run_root / "merged" / "merged_train.jsonl"

    @property
    def vocab_mapping(self) -> Path:
        return self.run_root / "vocab" / "vocab_mapping.safetensors"

    def hidden_version_dir(self, version: str) -> "Location":
        from eagle3_dagster.storage import location

        return location(self.hidden_root).join(version)

    @property
    def drafter_dir(self) -> Path:
        return self.run_root / "drafter"

    @property
    def bench_dir(self) -> Path:
        return self.run_root / "bench"

    @classmethod
    def from_profile(cls, profile) -> "ArtifactLayout":
        from eagle3_dagster.config import PROJECT_ROOT
        from eagle3_dagster.storage import location

        staging = profile.hidden.staging_dir
        return cls(
            run_root=profile.path(),
            hidden_root=location(profile.hidden.root, PROJECT_ROOT),
            hidden_staging=None if staging is None else location(staging, PROJECT_ROOT).local_path(),
        )
