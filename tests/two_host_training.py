"""drafter_checkpoint on two GPU hosts: two real sshd on this machine, one gloo rank on each (train.nnodes 2).

`two_host_training(root, micro_target)` starts the two sshd "hosts" (tests/sshd_server.py), writes the micro
profile with both under `gpu_host.hosts` and the training settings below, and materializes everything
drafter_checkpoint reads into a real Dagster instance (the project's dagster.yaml, SQLite, under `root`):
`scripts/run_pipeline.py --from data --until extract`, with the session's micro target copied in rather than
built (~25 s of CPU). `TwoHostTraining.materialize()` then runs drafter_checkpoint through Dagster
(`dg.execute_job` in this process, against that instance), as often as a test needs. Both hosts are this
machine, so they share the run_root file system as real hosts must.

A host's interpreter can be replaced (`python={"host-a": path}`), e.g. by a wrapper that runs torchrun's
worker under a test's own hooks (tests/e2e/test_multi_host_training.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
import pytest
import yaml

from tests.sshd_server import Sshd, start_sshd

REPO = Path(__file__).resolve().parents[1]
HOSTS = ("host-a", "host-b")
# A few optimizer steps at micro size with two checkpoints on the way: one rank per host, small batches so that
# the 20-odd micro samples make several steps per epoch.
TRAIN = {
    "nnodes": 2,
    "nproc_per_node": 1,
    "backend": "gloo",
    "max_steps": 8,
    "checkpoint_every": 3,
    "batch_tokens": 256,
}
# The retry policy of drafter_checkpoint resumes a failed attempt at once, in the same run; a test that wants
# to see the run fail, and start the next one itself, turns retries off (in-process executor).
NO_RETRIES = {"execution": {"config": {"retries": {"disabled": {}}}}}


def drafter_job() -> dg.JobDefinition:
    """train_job of the profile in EAGLE3_PROFILE; module level, so that `dg.reconstructable` can name it."""
    from definitions import build_definitions
    from eagle3_dagster.config import load_profile

    return build_definitions(load_profile()).resolve_job_def("train_job")


@dataclass
class TwoHostTraining:
    root: Path
    home: Path  # DAGSTER_HOME
    profile: Path
    env: dict[str, str]  # what the pipeline ran with
    servers: dict[str, Sshd]  # host name -> its sshd
    workdirs: dict[str, Path] = field(default_factory=dict)  # host name -> its gpu_host workdir (pid files)

    @property
    def drafter_dir(self) -> Path:
        return self.root / "run" / "drafter"

    def materialize(self, run_config: Mapping | None = NO_RETRIES) -> dg.ExecuteJobResult:
        """drafter_checkpoint once, in this process, against the instance (the result's run is in it)."""
        # the profile drafter_job reads; one thread per rank (the stage passes the user's own on to the hosts)
        given = {"EAGLE3_PROFILE": str(self.profile), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with pytest.MonkeyPatch.context() as mp:
            for key, value in given.items():
                mp.setenv(key, value)
            with dg.DagsterInstance.from_config(str(self.home)) as instance:
                return dg.execute_job(
                    dg.reconstructable(drafter_job),
                    instance,
                    asset_selection=[dg.AssetKey("drafter_checkpoint")],
                    run_config=dict(run_config or {}),
                    raise_on_error=False,
                )

    @contextmanager
    def instance(self) -> Iterator[dg.DagsterInstance]:
        with dg.DagsterInstance.from_config(str(self.home)) as instance:
            yield instance

    def stderr_of(self, run_id: str) -> str:
        """The run's captured stderr (the instance's compute logs: LocalComputeLogManager under storage/)."""
        return "".join(
            p.read_text(errors="replace")
            for p in sorted((self.home / "storage" / run_id / "compute_logs").glob("*.err"))
        )

    def run_dirs(self) -> list[Path]:
        return sorted(p for p in self.drafter_dir.glob("run-*") if p.is_dir())


def write_profile(root: Path, servers: Mapping[str, Sshd], python: Mapping[str, str], train: Mapping) -> Path:
    raw = yaml.safe_load((REPO / "configs" / "micro.yaml").read_text())
    raw["run_root"] = str(root / "run")
    raw["hidden"]["root"] = str(root / "run" / "hidden_states")  # both "hosts" see it: this machine
    raw["hidden"]["samples_per_shard"] = 64  # every micro sample in one shard: one extraction, one torch import
    raw["train"] |= dict(train)
    raw["gpu_host"] = {
        "lease_dir": str(root / "leases"),
        "hosts": [
            {
                "name": name,
                "transport": "ssh",
                "ssh_target": server.target,
                "ssh_options": list(server.options),
                "python": python.get(name, sys.executable),
                "workdir": str(root / f"work_{name}"),
            }
            for name, server in servers.items()
        ],
    }
    path = root / "micro_two_hosts.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@contextmanager
def two_host_training(
    root: Path, micro_target: Path, *, python: Mapping[str, str] | None = None, train: Mapping | None = None
) -> Iterator[TwoHostTraining]:
    """Two sshd hosts and an instance holding every input of drafter_checkpoint; the servers stop after."""
    servers: dict[str, Sshd] = {}
    try:
        for name in HOSTS:
            servers[name] = start_sshd(root / f"sshd_{name}")
        profile = write_profile(root, servers, python or {}, {**TRAIN, **(train or {})})
        home = root / "dagster_home"
        home.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
        shutil.copytree(micro_target, root / "run" / "target")
        env = {
            **os.environ,
            "DAGSTER_HOME": str(home),
            "EAGLE3_PROFILE": str(profile),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
        }
        built = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "run_pipeline.py"), "--from", "data", "--until", "extract"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=1500,
        )
        if built.returncode != 0:
            raise RuntimeError(
                f"the micro inputs of drafter_checkpoint failed:\n{built.stdout[-3000:]}{built.stderr[-3000:]}"
            )
        yield TwoHostTraining(root, home, profile, env, servers, {n: root / f"work_{n}" for n in HOSTS})
    finally:
        for server in servers.values():
            server.stop()
