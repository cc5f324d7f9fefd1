"""The MLA drafter (`drafter.attention: mla`) served by SGLang's own server (0.5.23, CPU): what is trained is what
is served, as test_real_eagle3.py checks for the GQA drafter.

The same 6-layer tiny target, training and held-out prompts as test_real_eagle3.py (its fixtures and helpers): a
drafter of multi-latent attention with the target's MLA sizes (`DrafterConfig.from_profile`, as the training worker
builds it), trained for a few seconds with the project's TTT objective and written by the project's export for
0.5.23 (`Eagle3DeepseekV2ForCausalLM`, `drafter/mla_export.py`), is served by the release server with the served
benchmark's launch flags (`stages.bench.serving_spec`) and the tier's CPU options (`SERVER_ARGS`, `intel_amx`
attention, `--dtype float32`). SGLang builds the drafter as `kimi_k25_eagle3.py`'s class (its "Load weight end"
line names it) and drafts through DeepSeek's MLA attention (`DeepseekV2AttentionMLA`) on its latent KV cache.

Per held-out prompt: the served output equals the target's greedy output (transformers, float32), token for token,
and SGLang's verify steps (`meta_info.spec_verify_ct`) equal the project's simulator's exactly
(`bench.specdec.generate_speculative` with the export loaded by `drafter.imported.load_any_drafter`); tolerance
none, for the reasons test_real_eagle3.py gives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.real_sglang.test_real_eagle3 import (  # noqa: F401 (eagle3_profile, eagle3_target: its fixtures)
    _train_and_export,
    eagle3_profile,
    eagle3_target,
    served_against_simulated,
)
from tests.sglang_cpu.venv import server_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
]  # SGLang's own release server on CPU, in a venv built from PyPI (tests/sglang_cpu)

MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"


@pytest.fixture(scope="module")
def eagle3_mla_profile(eagle3_profile):
    """test_real_eagle3's profile (micro, 6 layers, aux [2, 3, 4], served by VERSION) with an MLA drafter."""
    from eagle3_dagster.config import load_profile
    from tests.real_sglang.support import VERSION

    return load_profile(
        "micro",
        overrides={
            "target": {"tiny": {"num_hidden_layers": 6}},
            "hidden": {"aux_layers": [2, 3, 4]},
            "gpu_host": {"sglang_version": VERSION},
            "drafter": {"attention": "mla"},
        },
    )


@pytest.fixture(scope="module")
def mla_export(tmp_path_factory, eagle3_target, eagle3_mla_profile) -> Path:
    """The MLA drafter, trained briefly and exported for VERSION (`Eagle3DeepseekV2ForCausalLM`)."""
    export = _train_and_export(eagle3_target, eagle3_mla_profile, tmp_path_factory.mktemp("mla") / "export")
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == [MLA_ARCHITECTURE] and config["kv_lora_rank"]
    return export


@pytest.mark.timeout(3600)
def test_served_mla_drafter_output_is_the_targets_greedy_output_and_its_verify_steps_the_simulators(
    sglang_python, eagle3_target, eagle3_mla_profile, mla_export, tmp_path
):
    logs = []
    rows = served_against_simulated(
        sglang_python,
        eagle3_target,
        eagle3_mla_profile,
        mla_export,
        tmp_path,
        env=server_env(sglang_python, cuda_sync=True),
        on_log=logs.append,
    )
    assert f"type={MLA_ARCHITECTURE}" in logs[0], logs[0][-3000:]  # SGLang's "Load weight end" line: the drafter
    table = "\n".join(json.dumps(r) for r in rows)
    assert [r["sglang_verify_ct"] for r in rows] == [r["sim_verify_ct"] for r in rows], table


@pytest.mark.timeout(3600)
def test_served_mla_drafter_through_kimi_k25s_class_is_the_simulators(
    sglang_python, eagle3_target, eagle3_mla_profile, mla_export, tmp_path
):
    """The same export drafting for the same target wrapped in Kimi-K2.5's checkpoint layout
    (`tiny.kimi_k25.wrap_as_kimi_k25`, served with `--trust-remote-code` as `KimiK25ForConditionalGeneration`, the
    class production serves: test_real_kimi_k25.py), against the simulator on the unwrapped target."""
    from eagle3_dagster.tiny.kimi_k25 import wrap_as_kimi_k25

    kimi = wrap_as_kimi_k25(eagle3_target, tmp_path / "kimi_k25")
    logs = []
    rows = served_against_simulated(
        sglang_python,
        eagle3_target,
        eagle3_mla_profile,
        mla_export,
        tmp_path,
        served_target=kimi,
        trust_remote_code=True,
        env=server_env(sglang_python, cuda_sync=True),
        on_log=logs.append,
    )
    for cls in ("KimiK25ForConditionalGeneration", MLA_ARCHITECTURE):  # SGLang's "Load weight end" lines
        assert f"type={cls}" in logs[0], logs[0][-3000:]
    table = "\n".join(json.dumps(r) for r in rows)
    assert [r["sglang_verify_ct"] for r in rows] == [r["sim_verify_ct"] for r in rows], table
