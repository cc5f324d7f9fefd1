"""The SGLang branch of hidden_states through Dagster, on SGLang's own server (0.5.23, CPU).

As tests/assets/test_sglang_stage.py, but the GPU host's interpreter is the real-SGLang venv
(tests/sglang_cpu): the stage runs its real preflight (patch state by sha256, no GPUs needed with
`--device cpu`), launches the patched release server with the release's extraction options and the
profile's `hidden.sglang_server_args`, runs the driver on the host and commits the shard through the
normal skeleton. The shard must have the bytes the plan predicted and hold the target's states
(within ENVELOPE_FACTOR of the float16 envelope, tests/real_sglang/support.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import dagster as dg
import orjson
import pytest
import torch

from definitions import build_definitions
from eagle3_dagster.config import load_profile
from eagle3_dagster.contracts import ArtifactLayout
from eagle3_dagster.hidden.shards import load_manifest
from tests.real_sglang.support import compare_with_hf
from tests.sshd_server import free_port
from tests.sglang_cpu.venv import SERVER_ARGS, server_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.sglang,
]  # SGLang's own release server on CPU, in a venv built from PyPI (tests/sglang_cpu)

LENGTHS = [90, 17, 130, 66]


@pytest.mark.timeout(3600)
def test_hidden_states_materializes_on_the_real_server_with_the_plans_bytes(
    sglang_python, micro_target, tmp_path, monkeypatch
):
    for name, value in server_env(sglang_python).items():  # the launcher's server inherits this environment
        monkeypatch.setenv(name, value)
    profile = load_profile(
        "micro",
        overrides={
            "run_root": str(tmp_path / "run"),
            "hidden": {
                "backend": "sglang",
                "root": str(tmp_path / "hidden"),
                "tp_size": 1,
                "sglang_port": free_port(),
                "samples_per_shard": len(LENGTHS),
                "sglang_concurrency": len(LENGTHS),
                "sglang_server_args": [*SERVER_ARGS, "--chunked-prefill-size", "64"],
            },
            # no gpu_host.sglang_version: the micro aux layers [1, 2, 3] are no draft config's on 0.5.23 (the export's
            # concern); extraction reads the release from the host's preflight
            "gpu_host": {"hosts": [{"python": str(sglang_python), "workdir": str(tmp_path / "work")}]},
        },
    )
    layout = ArtifactLayout.from_profile(profile)
    # what target_model builds for these target settings: the session's micro target (a build is ~20 s of CPU)
    shutil.copytree(micro_target, layout.target_dir)
    vocab = json.loads((layout.target_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(5)
    layout.merged_train.parent.mkdir(parents=True, exist_ok=True)
    samples = {}
    with open(layout.merged_train, "wb") as f:
        for k, n in enumerate(LENGTHS):
            ids = torch.randint(3, vocab, (n,), generator=g).tolist()
            samples[f"B1/conv{k}/0"] = ids
            f.write(
                orjson.dumps(
                    {
                        "id": f"B1/conv{k}/0",
                        "dataset": "B1",
                        "input_ids": ids,
                        "loss_mask": [0] * (n // 2) + [1] * (n - n // 2),
                    }
                )
                + b"\n"
            )
    defs = build_definitions(profile)
    assets = list(defs.assets or [])
    with dg.instance_for_test() as instance:
        plan = dg.materialize(assets, selection=["extraction_plan"], instance=instance, resources=defs.resources)
        instance.add_dynamic_partitions("hidden_state_shards", ["shard-00000"])
        result = dg.materialize(
            assets,
            selection=["hidden_states"],
            instance=instance,
            resources=defs.resources,
            partition_key="shard-00000",
            raise_on_error=False,
        )
        assert result.success, [e.message for e in result.all_events if e.is_failure]
        checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert checks == {"bytes_match_plan": True, "manifest_checksums": True}
        mat = result.asset_materializations_for_node("hidden_states")[0]
        log = Path(mat.metadata["sglang_log"].value).read_text()
        assert "--attention-backend" in log or "torch_native" in log  # SGLang's own server_args line
    version_dir = Path(plan.asset_materializations_for_node("extraction_plan")[0].metadata["version_dir"].value)
    manifest = load_manifest(version_dir)
    assert [s["id"] for s in manifest["shard-00000"]["samples"]] == list(samples)
    table, failures = compare_with_hf(
        version_dir, [{"id": k, "input_ids": v} for k, v in samples.items()], layout.target_dir
    )
    assert not failures, f"{failures}\n{table}"
    assert not any((Path(layout.hidden_root) / ".dumps").rglob("*.safetensors"))
