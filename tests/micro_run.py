"""The micro pipeline materialized once per test session, shared by the tests that only read it.

`scripts/run_pipeline.py` (what `scripts/demo.sh` runs) in a subprocess: the whole graph at micro size,
the micro profile pointed at a temp folder, on the production instance: a fresh DAGSTER_HOME holding
deploy/postgres/dagster.yaml (the checked-in dagster_home/dagster.yaml with runs, event logs and
schedules in PostgreSQL) against the session's own PostgreSQL server (`tests/postgres_server.py`).
One run serves tests/assets/test_micro_pipeline.py (the demo's assets, checks, figures, lineage and logs)
and tests/assets/test_postgres_instance.py (the same records as rows in PostgreSQL; a code server and a
daemon taking queued runs); each of them used to build the micro graph itself.

Readers leave it as they found it: they open the instance and read files. A test that edits shards,
manifests or the instance works on `private_copy`: the run folder copied, with a fresh SQLite instance
(dagster_home/dagster.yaml) where the corpus and the shards are materialized again from the copied files
(`run_pipeline.py --from corpus --until extract`: no target build, no regeneration, every shard found
complete in its manifest).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "scripts" / "run_pipeline.py"
# every asset the micro run materializes, in graph order
MICRO_ASSETS = [
    "target_model",
    "raw_responses",
    "tokenized_dataset",
    "merged_train",
    "vocab_mapping",
    "extraction_plan",
    "hidden_states",
    "drafter_checkpoint",
    "benchmark_report",
]


def micro_profile_in(tmp: Path) -> Path:
    """configs/micro.yaml with every output under `tmp/run`."""
    raw = yaml.safe_load((ROOT / "configs" / "micro.yaml").read_text())
    raw["run_root"] = str(tmp / "run")
    raw["hidden"]["root"] = str(tmp / "run" / "hidden_states")
    path = tmp / "micro.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_pipeline(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`scripts/run_pipeline.py` on DAGSTER_HOME; its output (a line per job with its seconds) also goes to
    pipeline.log beside DAGSTER_HOME."""
    proc = subprocess.run(
        [sys.executable, str(PIPELINE), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500
    )
    (Path(env["DAGSTER_HOME"]).parent / "pipeline.log").write_text(proc.stdout + proc.stderr)
    return proc


@dataclass(frozen=True)
class MicroRun:
    """A materialized micro graph: its instance folder, its profile, and the pipeline's output."""

    home: Path  # DAGSTER_HOME
    profile: Path  # the micro profile, outputs under profile.parent / "run"
    env: dict[str, str]  # what the pipeline ran with: DAGSTER_HOME, EAGLE3_PROFILE, DAGSTER_PG_* if on PostgreSQL
    proc: subprocess.CompletedProcess

    @contextmanager
    def instance(self) -> Iterator[dg.DagsterInstance]:
        """The run's instance, its DAGSTER_PG_* variables set only while it is opened."""
        with pytest.MonkeyPatch.context() as mp:
            for key, value in self.env.items():
                if key.startswith("DAGSTER_PG_"):
                    mp.setenv(key, value)
            instance = dg.DagsterInstance.from_config(str(self.home))
        with instance:
            yield instance

    def output(self, chars: int = 4000) -> str:
        return self.proc.stdout[-chars:] + self.proc.stderr[-chars:]


def materialize_micro_graph(tmp: Path, instance_yaml: Path, extra_env: dict[str, str]) -> MicroRun:
    home = tmp / "dagster_home"
    home.mkdir()
    shutil.copy(instance_yaml, home / "dagster.yaml")
    profile = micro_profile_in(tmp)
    env = (
        os.environ
        | extra_env
        | {
            "DAGSTER_HOME": str(home),
            "EAGLE3_PROFILE": str(profile),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    return MicroRun(home, profile, env, run_pipeline(env))


def private_copy(run: MicroRun, tmp: Path) -> MicroRun:
    """`run`'s files under `tmp`, on a fresh SQLite instance with the corpus and every shard materialized
    (found complete in the copied manifests), for a test that edits them."""
    shutil.copytree(run.profile.parent / "run", tmp / "run", symlinks=True)
    home = tmp / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    profile = micro_profile_in(tmp)
    env = {k: v for k, v in run.env.items() if not k.startswith("DAGSTER_PG_")}
    env |= {"DAGSTER_HOME": str(home), "EAGLE3_PROFILE": str(profile)}
    return MicroRun(home, profile, env, run_pipeline(env, "--from", "corpus", "--until", "extract"))
