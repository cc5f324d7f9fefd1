"""Shared fixtures: the micro profile and a tiny target built once per test session.

The micro target is the real demo build (BPE on ShareGPT, DeepSeek-V3 with MLA
and MoE, pre-training, verified save) at a few hundred thousand parameters; it
builds in a few seconds, so every test that needs a target uses the real one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def micro_profile():
    from eagle3_dagster.config import load_profile

    return load_profile("micro")


@pytest.fixture(scope="session")
def micro_target(tmp_path_factory, micro_profile) -> Path:
    """Directory of the micro tiny target (tokenizer, chat template, safetensors weights, build_report.json).

    Treat it as read-only: it is shared by every test in the session.
    """
    from eagle3_dagster.tiny.build import build_tiny_target

    out = tmp_path_factory.mktemp("micro_target") / "target"
    build_tiny_target(micro_profile.target.tiny, out)
    return out


# The full tier only (`scripts/test.sh`, CI): node-id prefixes of the tests a developer does not run on
# every change, each with what makes it slow. A plain `pytest` deselects them (pyproject `addopts`).
SLOW = {
    "tests/assets/test_micro_pipeline.py": "the demo pipeline end to end in a subprocess",
    "tests/assets/test_packaging.py": "builds and installs the wheel",
    "tests/assets/test_postgres_instance.py": "a PostgreSQL server and the micro pipeline through extraction on it",
    "tests/assets/test_sglang_stage.py": "a patched SGLang site and stand-in servers on the host",
    "tests/real_sglang/": "SGLang's own release server on CPU, in a venv built from PyPI (tests/sglang_cpu)",
    "tests/assets/test_definitions.py::test_dagster_cli_validates_the_workspace": "the dagster CLI in a subprocess",
    "tests/unit/test_train.py::test_two_rank_gloo_training": "torchrun, 2 ranks",
    "tests/unit/test_train.py::test_resume_after_kill": "torchrun twice",
    "tests/unit/test_train.py::test_single_node_run_through_the_c10d": "torchrun with a c10d rendezvous",
    "tests/unit/test_merge.py::test_peak_memory_stays_bounded": "a 150 MB corpus",
    "tests/unit/test_extract_hf.py::test_resume_after_kill": "an extraction subprocess killed and resumed",
    "tests/unit/test_gpu_host.py": "a real sshd and server processes",
    "tests/unit/test_deploy_configs.py::test_launcher_samples_pass": "installs dagster-k8s and dagster-docker into .cache/",
    "tests/unit/test_gpu_install.py": "every supported SGLang release's metadata",
    "tests/unit/test_sglang_patch.py": "every supported SGLang release's wheel: generated, patched, reverted",
    "tests/unit/test_served_bench.py": "stand-in SGLang server processes on the host",
    "tests/unit/test_tiny_target.py::test_build_is_deterministic_for_a_seed": "two target builds",
    "tests/unit/test_cli.py::test_profile_is_accepted_after_the_subcommand_too": "the eagle3 command in subprocesses",
    "tests/unit/test_sharegpt.py::test_heldout_and_train_splits_are_disjoint_stable_and_cover_everything":
        "reads the whole bundled ShareGPT file",
    "tests/unit/test_spec_sampling.py::test_plain_sampling": "1,200 seeded generations of a tiny target",
    "tests/unit/test_spec_sampling.py::test_speculative_sampling_with_sglangs_rule":
        "1,200 seeded speculative generations of a tiny target",
    "tests/unit/test_spec_sampling.py::test_a_lossy_verification_rule": "2 x 600 seeded speculative generations",
    "tests/unit/test_stages_in_process.py::test_benchmark_stage_in_process_writes_results_and_compares_with_the_previous_report":
        "speculative decoding of the micro target, twice",
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if any(item.nodeid.startswith(prefix) for prefix in SLOW):
            item.add_marker(pytest.mark.slow)
        if item.nodeid.startswith("tests/real_sglang/"):
            item.add_marker(pytest.mark.sglang)
