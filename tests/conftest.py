"""Shared fixtures: the micro profile, a tiny target and the micro pipeline, each built once per test session.

The micro target is the real demo build (BPE on ShareGPT, DeepSeek-V3 with MLA
and MoE, pre-training, verified save) at a few hundred thousand parameters; it
builds in a few seconds, so every test that needs a target uses the real one.
The micro pipeline (`micro_run`, tests/micro_run.py) is the whole graph through
Dagster on a real PostgreSQL instance, for the full tier's tests that read it.
"""

from __future__ import annotations

import fcntl
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The suite runs as from a terminal, whatever started it (tests/unit/test_suite_signals.py): a command
# started in the background of a non-interactive shell inherits SIGINT ignored, and so would every process
# the tests start (`dagster dev` stops at SIGINT), and Dagster's in-process executions would map SIGTERM
# to that ignore as well (`setup_interrupt_handlers`).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def micro_profile():
    from eagle3_dagster.config import load_profile

    return load_profile("micro")


@pytest.fixture(scope="session")
def micro_target(tmp_path_factory, micro_profile) -> Path:
    """Directory of the micro tiny target (tokenizer, chat template, safetensors weights, build_report.json).

    Treat it as read-only: it is shared by every test in the session, on every xdist worker (the first
    worker to want it builds it, under a lock; the others wait and read it: a build is ~20 s of CPU).
    """
    import torch

    from eagle3_dagster.threads import stage_threads
    from eagle3_dagster.tiny.build import build_tiny_target

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: basetemp/popen-gwN
    out = shared / "micro_target" / "target"
    out.parent.mkdir(exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():  # build_tiny_target renames a whole build into place
            # The target stage's thread count, the free cores: beside other work torch's default of a thread
            # per core is several times slower (docs/benchmarks.md); scripts/test.sh's OMP_NUM_THREADS wins.
            # The count is in build_report.json; the session's own is restored after.
            threads = torch.get_num_threads()
            stage_threads(load_aware=True)
            try:
                build_tiny_target(micro_profile.target.tiny, out)
            finally:
                torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def sshd(tmp_path_factory) -> Iterator[tuple[str, tuple[str, ...]]]:
    """A real sshd on a loopback port accepting a throwaway key for the current user (tests/sshd_server.py),
    one per test module: (ssh target, ssh options)."""
    from tests.sshd_server import start_sshd

    try:
        server = start_sshd(tmp_path_factory.mktemp("sshd"))
    except (FileNotFoundError, RuntimeError) as e:
        pytest.fail(str(e))
    yield server.target, server.options
    server.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator:
    """A PostgreSQL server for the session (tests/postgres_server.py)."""
    from tests.postgres_server import start_postgres

    with start_postgres() as server:
        yield server


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory, postgres):
    """The micro graph materialized once (tests/micro_run.py). Read it, never edit it: a test that edits
    shards, manifests or the instance takes `tests.micro_run.private_copy` of it."""
    from tests.micro_run import ROOT, materialize_micro_graph

    run = materialize_micro_graph(
        tmp_path_factory.mktemp("micro_run"), ROOT / "deploy" / "postgres" / "dagster.yaml", postgres.env
    )
    if run.proc.returncode != 0:
        pytest.fail(f"the shared micro pipeline failed:\n{run.output()}")
    return run


FULL_TIER_MARKERS = ("slow", "e2e", "sglang")  # the markers pyproject.toml's fast-tier selection leaves out


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """`scripts/test.sh` runs the tiers on pytest-xdist workers with `--dist loadgroup`, where a group runs
    on one worker. Each module is its own group, so that its module-scoped fixtures (a `dagster dev`, sshd,
    a served target) start once; modules sharing a session fixture too costly to build twice name one group
    (`xdist_group("micro_run")`: the micro pipeline on PostgreSQL).

    Workers take groups in the order of `items`: the groups holding a full-tier test (slow, e2e, sglang: servers,
    torchrun, pipelines) go first, then the fast tier's, each in collection order. The short groups then fill
    the end on whichever worker is free, where one long group last (test_train.py, ~40 s) left the other
    worker idle."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    group = {id(item): item.get_closest_marker("xdist_group").args[0] for item in items}
    heavy = {group[id(item)] for item in items if any(item.get_closest_marker(m) for m in FULL_TIER_MARKERS)}
    items.sort(key=lambda item: group[id(item)] not in heavy)  # stable: collection order within each part
