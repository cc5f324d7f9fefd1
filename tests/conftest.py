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

