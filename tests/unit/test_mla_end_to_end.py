"""An MLA drafter through the same machinery as the GQA one: torchrun training that resumes exactly, the held-out
evaluation, metrics and a checked export; and the in-process benchmark of a Kimi MLA drafter folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_dagster.config import DrafterOverrides
from eagle3_dagster.drafter.export import check_export
from test_train import _torchrun, _why, train_job, workspace  # noqa: F401  (fixture)
from eagle3_dagster.stages.bench import BenchSettings


def _mla_job(ws: Path, out: str) -> Path:
    # the chains target's aux layers [1, 2, 3]: ids [0, 1, 2] on 0.5.12 (always + 1), no ids on 0.5.13+
    drafter = DrafterOverrides(attention="mla", intermediate_size=64)
    return train_job(ws, out, drafter, {"max_steps": 16}, sglang_versions=("0.5.12",))


@pytest.mark.slow  # torchrun, 2 ranks, three times
def test_mla_training_learns_resumes_exactly_and_exports_what_sglang_loads(workspace):
    whole = _torchrun(workspace, _mla_job(workspace, "mla_a"))
    assert whole.returncode == 0, _why(whole)
    m = json.loads((workspace / "mla_a" / "metrics.json").read_text())
    assert m["drafter_config"]["attention"] == "mla" and m["drafter_config"]["kv_lora_rank"] == 8  # the target's
    before, after = m["initial_eval"], m["final_eval"]
    assert after["scope"] == "heldout" and after["loss"] < before["loss"]
    export = workspace / "mla_a" / "export"
    assert check_export(export).ok
    assert json.loads((export / "config.json").read_text())["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]

    cfg = _mla_job(workspace, "mla_b")
    assert _torchrun(workspace, cfg, "--stop-after-step", "12").returncode != 0
    resumed = _torchrun(workspace, cfg)
    assert resumed.returncode == 0, _why(resumed)
    a = load_file(str(workspace / "mla_a" / "ckpt" / "step_0000016" / "model.safetensors"))
    b = load_file(str(workspace / "mla_b" / "ckpt" / "step_0000016" / "model.safetensors"))
    assert a.keys() == b.keys() and "midlayer.self_attn.kv_b_proj.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_inprocess_benchmark_measures_a_kimi_mla_drafter_folder(tmp_path, micro_target):
    """What `eagle3 bench --drafter DIR` runs (the benchmark stage) on a folder in kimi-k2.5-eagle3-mla's layout."""
    import orjson
    from safetensors.torch import save_file

    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import ArtifactLayout
    from eagle3_dagster.drafter.mla_export import to_checkpoint
    from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_dagster.drafter.target_head import load_target_tensors
    from eagle3_dagster.stages.bench import benchmark_stage

    profile = load_profile(
        "micro",
        overrides={
            "run_root": str(tmp_path / "run"),
            "target": {"kind": "external", "path": str(micro_target)},
            "hidden": {"root": str(tmp_path / "hs")},
            "gpu_host": {"sglang_version": "0.5.12"},
            "drafter": {"attention": "mla"},
            "bench": {"spec_configs": [[2, 1, 3]], "num_prompts": 2, "max_new_tokens": 8},
        },
    )
    target = load_target_tensors(micro_target, ("embed",))
    cfg = DrafterConfig.from_profile(
        profile.drafter, target.arch, draft_vocab_size=64, aux_layers=(1, 2, 3), serving_context=512
    )
    t2d = torch.zeros(target.arch.vocab_size, dtype=torch.bool)
    t2d[torch.arange(0, 128, 2)] = True
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, target.embed.float(), torch.arange(0, 128, 2) - torch.arange(64), t2d)
    folder = tmp_path / "kimi-mla"
    folder.mkdir()
    save_file(
        {k: v.contiguous() for k, v in to_checkpoint(drafter.trainable_state_dict()).items()},
        str(folder / "model.safetensors"),
    )
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Eagle3DeepseekV2ForCausalLM"],
                "model_type": "kimi_k2",
                "num_hidden_layers": 1,
                **{
                    k: getattr(cfg, k)
                    for k in (
                        "hidden_size",
                        "intermediate_size",
                        "num_attention_heads",
                        "q_lora_rank",
                        "kv_lora_rank",
                        "qk_nope_head_dim",
                        "qk_rope_head_dim",
                        "v_head_dim",
                        "vocab_size",
                        "draft_vocab_size",
                        "rms_norm_eps",
                        "rope_theta",
                        "rope_scaling",
                    )
                },
                "max_position_embeddings": 512,
                "tie_word_embeddings": False,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
            }
        )
    )
    report = benchmark_stage(
        BenchSettings.from_profile(profile),
        ArtifactLayout.from_profile(profile),
        export_dir=folder,
        previous_results=None,
        run_id="mla",
        progress=lambda _line: None,
        out_dir=tmp_path / "out",
    )
    meta = report.metadata
    assert meta["drafter_source"] == "external" and meta["drafter_aux_layers"] == [1, 2, 3]
    results = orjson.loads((tmp_path / "out" / "results-mla.json").read_bytes())
    assert {r["method"] for r in results["rows"]} == {"no_spec", "eagle3", "eagle3_untrained", "ngram"}
