"""The SGLang branch of hidden_states, end to end through Dagster, on CPU.

The GPU host is this machine (local transport) with an interpreter whose site holds a real
release's `deepseek_v2.py`, patched by `eagle3 patch apply`, and `sglang/launch_server.py` =
tests/sglang_extraction_standin.py: the stage runs its real preflight, its real server command line
(the release's extraction options; the stand-in exits like argparse on an option the release lacks),
the real extraction driver on the host, and the real dump hook inside the stand-in. The shards must
be the bytes the plan predicted (`bytes_match_plan`), pass their checksums, and hold the target's
states; a failing driver must bring the SGLang log tail and its own traceback into the error.
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
from eagle3_dagster.hidden.dataset import HiddenStatesDataset
from eagle3_dagster.hidden.shards import load_manifest
from eagle3_dagster.sglang import patch
from tests import sglang_wheels
from tests.sshd_server import free_port
from eagle3_dagster.stages.hidden import ExtractSettings

pytestmark = pytest.mark.slow  # a patched SGLang site and stand-in servers on the host

ROOT = Path(__file__).resolve().parents[2]
RELEASE = "0.5.12"  # a loop-style release; the micro target's aux layers [1, 2, 3] are expressible there


@pytest.fixture(scope="module")
def setup(tmp_path_factory, micro_target):
    tmp = tmp_path_factory.mktemp("sglang_stage")
    python = sglang_wheels.make_site(RELEASE, tmp / "host", extra_paths=(ROOT,))
    site = python.parent / "site"
    shutil.copy(ROOT / "tests" / "sglang_extraction_standin.py", site / "sglang" / "launch_server.py")
    assert patch.apply(str(python)).startswith("patched")
    bin_dir = tmp / "bin"  # the host's GPU, as nvidia-smi reports it (the preflight's first probe)
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stand-in (UUID: GPU-0)'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    profile = load_profile(
        "micro",
        overrides={
            "run_root": str(tmp / "run"),
            "hidden": {
                "backend": "sglang",
                "root": str(tmp / "hidden"),
                "tp_size": 1,
                "sglang_port": free_port(),
                "samples_per_shard": 4,
                "sglang_concurrency": 2,
            },
            "gpu_host": {"hosts": [{"transport": "local", "python": str(python), "workdir": str(tmp / "work")}]},
        },
    )
    layout = ArtifactLayout.from_profile(profile)
    shutil.copytree(micro_target, layout.target_dir)  # the session's micro target: this profile's target.tiny
    vocab = json.loads((layout.target_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(3)
    layout.merged_train.parent.mkdir(parents=True, exist_ok=True)
    with open(layout.merged_train, "wb") as f:
        for k, n in enumerate([7, 19, 3, 11, 5, 13]):
            ids = torch.randint(1, vocab, (n,), generator=g).tolist()
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
    return tmp, profile, layout, bin_dir


def _materialize(defs, instance, selection, partition_key=None):
    assets = list(defs.assets or [])
    return dg.materialize(
        assets,
        selection=selection,
        instance=instance,
        resources=defs.resources,
        partition_key=partition_key,
        raise_on_error=False,
    )


def test_sglang_stage_extracts_shards_with_the_plans_bytes_through_dagster(setup, monkeypatch):
    tmp, profile, layout, bin_dir = setup
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    defs = build_definitions(profile)
    with dg.instance_for_test() as instance:
        plan = _materialize(defs, instance, ["extraction_plan"])
        assert plan.success
        # from here on the plan file is read, never recomputed: merged_train is not parsed or hashed again
        from eagle3_dagster.hidden import extraction_plan as extraction_plan_module

        def recomputed(*args, **kwargs):
            raise AssertionError("a shard run re-parsed or re-hashed merged_train instead of reading the plan")

        monkeypatch.setattr(extraction_plan_module, "sha256_file", recomputed)
        monkeypatch.setattr(extraction_plan_module, "plan_shards", recomputed)
        instance.add_dynamic_partitions("hidden_state_shards", ["shard-00000", "shard-00001"])
        result = _materialize(defs, instance, ["hidden_states"], partition_key="shard-00001")
        assert result.success, [e.message for e in result.all_events if e.is_failure]
        checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        assert checks == {"bytes_match_plan": True, "manifest_checksums": True}
        mat = result.asset_materializations_for_node("hidden_states")[0]
        log_path = Path(mat.metadata["sglang_log"].value)
        assert "stand-in sglang: ready" in log_path.read_text()
    version_dir = Path(plan.asset_materializations_for_node("extraction_plan")[0].metadata["version_dir"].value)
    manifest = load_manifest(version_dir)
    assert list(manifest) == ["shard-00001"]
    assert [s["id"] for s in manifest["shard-00001"]["samples"]] == ["B1/conv4/0", "B1/conv5/0"]
    # the stored states are the target's: HF output_hidden_states at the canonical aux layers
    from transformers import AutoModel

    model = AutoModel.from_pretrained(layout.target_dir, dtype=torch.float32).eval()
    ds = HiddenStatesDataset(version_dir)
    for k in range(len(ds)):
        sample = ds[k]
        with torch.inference_mode():
            out = model(input_ids=sample["input_ids"][None], output_hidden_states=True, use_cache=False)
        want = torch.cat([out.hidden_states[i][0] for i in (1, 2, 3)], dim=-1)
        torch.testing.assert_close(sample["aux_hidden"].float(), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sample["last_hidden"].float(), out.last_hidden_state[0], rtol=1e-4, atol=1e-4)
    assert not any((Path(layout.hidden_root) / ".dumps").rglob("*.safetensors"))  # chunk files cleaned up


def test_driver_failure_brings_sglang_log_tail_and_traceback(setup, monkeypatch):
    tmp, profile, layout, bin_dir = setup
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    # a plan whose hidden size the dumps do not have: the driver fails on the host, naming the sample
    import dataclasses

    from eagle3_dagster.hidden.extraction_plan import build_plan, write_plan
    from eagle3_dagster.stages import hidden as hidden_stage

    plan = build_plan(profile, layout)
    # a version of its own under hidden.root (a shard run refuses a plan whose folder its settings do not name)
    broken = f"{plan.version}-broken"
    wrong = dataclasses.replace(
        plan,
        version=broken,
        version_dir=Path(profile.hidden.root) / broken,
        target=dataclasses.replace(plan.target, hidden_size=plan.target.hidden_size + 1),
        fmt=dataclasses.replace(plan.fmt, hidden_size=plan.fmt.hidden_size + 1),
    )
    plan_path = write_plan(wrong)
    with pytest.raises(RuntimeError) as err:
        hidden_stage.extract_stage(
            ExtractSettings.from_profile(profile),
            plan_path,
            ["shard-00000"],
            gpu_host=build_definitions(profile).resources["gpu_host"].host(),
        )
    text = str(err.value)
    assert "the SGLang driver exited" in text and "Traceback" in text and "DumpError" in text
    assert "stand-in sglang: ready" in text and "--- SGLang log" in text
