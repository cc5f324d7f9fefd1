"""`eagle3 plan` reports the draft KV cache: bytes per token and for one sequence at target.serving_context, GQA's
2 x num_key_value_heads x head_dim values against MLA's kv_lora_rank + qk_rope_head_dim."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_dagster.config import load_profile
from eagle3_dagster.stages.data import MergeSettings, TokenizeSettings, VocabSettings
from eagle3_dagster.stages.hidden import PlanSettings, draft_kv_cache

KIMI_TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "vocab_size": 163840,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_theta": 50000.0,
    "max_position_embeddings": 262144,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}


@pytest.fixture
def kimi_k25(tmp_path: Path) -> Path:
    """Kimi-K2.5's config.json (the multimodal wrapper, its text model's sizes): all the figure reads."""
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": KIMI_TEXT})
    )
    return tmp_path


def _production_like(**drafter):
    return load_profile(
        "micro",
        overrides={
            "target": {"dtype": "bfloat16", "serving_context": 262144},
            "hidden": {"aux_layers": [2, 30, 58]},
            "drafter": drafter,
        },
    )


def test_kimi_k25s_draft_kv_cache_gqa_and_mla(kimi_k25):
    gqa = draft_kv_cache(PlanSettings.from_profile(_production_like()), kimi_k25)
    # DeepSeek-V3 drafters' default: 56 heads of 128, 8 KV heads; bf16
    assert gqa["draft_attention"] == "gqa" and gqa["draft_kv_dtype"] == "bfloat16"
    assert gqa["draft_kv_values_per_token"] == 2 * 8 * 128
    assert gqa["draft_kv_bytes_per_token"] == 2 * 8 * 128 * 2 == 4096
    assert gqa["draft_kv_bytes_at_serving_context"] == 4096 * 262144
    assert gqa["draft_kv_at_serving_context_human"] == "1.0 GiB"
    mla = draft_kv_cache(PlanSettings.from_profile(_production_like(attention="mla")), kimi_k25)
    assert mla["draft_attention"] == "mla" and mla["draft_kv_values_per_token"] == 512 + 64
    assert mla["draft_kv_bytes_per_token"] == 576 * 2 == 1152
    assert mla["draft_kv_bytes_at_serving_context"] == 1152 * 262144
    assert mla["draft_kv_at_serving_context_human"] == "288.0 MiB"  # 0.28x the GQA drafter's


def test_the_figure_follows_the_profiles_sizes_and_dtype(kimi_k25):
    sized = _production_like(attention="mla", kv_lora_rank=256, qk_rope_head_dim=32)
    mla = draft_kv_cache(PlanSettings.from_profile(sized), kimi_k25)
    assert mla["draft_kv_bytes_per_token"] == (256 + 32) * 2
    fp32 = load_profile("micro", overrides={"drafter": {"attention": "mla"}, "hidden": {"aux_layers": [2, 3, 4]}})
    small = draft_kv_cache(PlanSettings.from_profile(fp32), kimi_k25)
    assert small["draft_kv_dtype"] == "float32" and small["draft_kv_bytes_per_token"] == 576 * 4
    assert small["draft_kv_bytes_at_serving_context"] == 576 * 4 * fp32.target.serving_context


def test_an_mla_drafter_for_a_target_without_mla_is_refused_by_the_plan_naming_the_field(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 64,
                "intermediate_size": 128,
                "vocab_size": 512,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
            }
        )
    )
    with pytest.raises(ValueError, match=r"drafter\.q_lora_rank"):
        draft_kv_cache(PlanSettings.from_profile(_production_like(attention="mla")), tmp_path)
    assert draft_kv_cache(PlanSettings.from_profile(_production_like()), tmp_path)["draft_attention"] == "gqa"


def test_the_plan_stage_reports_it_with_every_key_described(tmp_path, micro_target):
    """What `eagle3 plan` prints (plan_stage's metadata) and extraction_plan records, each key in the legend."""
    from assets.metadata_legend import undescribed
    from eagle3_dagster.stages.hidden import plan_stage
    from eagle3_dagster.stages.data import build_vocab, merge_partitions, tokenize_partition
    from test_stages_in_process import _two_partitions

    profile, layout = _two_partitions(tmp_path, micro_target)
    for name in ("a", "b"):
        tokenize_partition(TokenizeSettings.from_profile(profile), name, layout)
    merge_partitions(MergeSettings.from_profile(profile), layout)
    build_vocab(VocabSettings.from_profile(profile), layout)
    report, _, _ = plan_stage(PlanSettings.from_profile(profile), layout, free_bytes=None)
    meta = report.metadata
    assert (
        meta["draft_attention"] == "gqa"
        and meta["draft_kv_bytes_at_serving_context"]
        == meta["draft_kv_bytes_per_token"] * profile.target.serving_context
    )
    assert not undescribed("extraction_plan", meta)
