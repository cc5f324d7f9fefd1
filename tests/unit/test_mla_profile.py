"""`drafter.attention: mla`: the setting, the MLA sizes it takes from the target, and the SGLang releases that
can serve such a drafter (refused when the profile loads, naming the field or the release)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_dagster import sglang_releases
from eagle3_dagster.config import DrafterOverrides, ProfileError, TinyTargetConfig, load_profile
from eagle3_dagster.drafter.model import DrafterConfig
from eagle3_dagster.drafter.target_head import TargetArch

MICRO_MLA = {"drafter": {"attention": "mla"}, "gpu_host": {"sglang_version": "0.5.23"}}


def _tiny_target(tmp_path: Path, **rope) -> Path:
    """A DeepSeek-V3 target config as the tiny target writes it (transformers 5, rope_parameters)."""
    from eagle3_dagster.tiny.model import tiny_model_config

    cfg = tiny_model_config(
        TinyTargetConfig(
            hidden_size=64,
            num_attention_heads=2,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        ),
        vocab_size=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    cfg.save_pretrained(tmp_path)
    return tmp_path


def _llama_target(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 64,
                "intermediate_size": 128,
                "vocab_size": 512,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "rope_theta": 500000.0,
            }
        )
    )
    return tmp_path


def test_the_default_drafter_is_todays_gqa_layer_and_dumps_as_before():
    """A job or profile from before the setting hashes the same: the run folder and code version stay."""
    o = DrafterOverrides()
    assert o.attention == "gqa"
    assert o.model_dump() == {
        "hidden_size": None,
        "intermediate_size": None,
        "num_attention_heads": None,
        "num_key_value_heads": None,
        "fc_norm": False,
        "norm_output": False,
    }
    mla = DrafterOverrides(attention="mla", kv_lora_rank=64)
    assert mla.model_dump()["attention"] == "mla" and mla.model_dump()["kv_lora_rank"] == 64
    assert DrafterOverrides.model_validate(mla.model_dump()) == mla


@pytest.mark.parametrize(
    "drafter, field",
    [
        ({"kv_lora_rank": 64}, r"drafter\.kv_lora_rank: set, but only drafter\.attention: mla uses it"),
        ({"attention": "mla", "num_key_value_heads": 8}, r"drafter\.num_key_value_heads: MLA shares one"),
        ({"attention": "mla", "qk_rope_head_dim": 7}, r"drafter\.qk_rope_head_dim: 7 is odd"),
        ({"attention": "mla", "q_lora_rank": 0}, r"drafter\.q_lora_rank"),
        ({"attention": "mqa"}, r"drafter\.attention"),
    ],
)
def test_mla_settings_that_cannot_mean_anything_are_refused_naming_the_field(drafter, field):
    with pytest.raises(ProfileError, match=field):
        load_profile("micro", overrides={**MICRO_MLA, "drafter": drafter})


@pytest.mark.parametrize("version", ["0.5.10", "0.5.10.post1", "0.5.11"])
def test_a_release_without_an_mla_drafter_class_is_refused_at_profile_load_naming_it(version):
    """Every release in the table serves Kimi-K2.5 with EAGLE-3, but Eagle3DeepseekV2ForCausalLM came in 0.5.12."""
    assert sglang_releases.release(version).serves_kimi_k25_eagle3
    with pytest.raises(
        ProfileError,
        match=rf"drafter\.attention: mla, but gpu_host\.sglang_version: SGLang "
        rf"{version} cannot load an MLA drafter",
    ):
        load_profile("micro", overrides={**MICRO_MLA, "gpu_host": {"sglang_version": version}})
    assert load_profile("micro", overrides={"gpu_host": {"sglang_version": version}})  # a GQA drafter: served


def test_the_releases_that_serve_an_mla_drafter_come_from_their_wheels():
    table = {v: r.mla_drafter for v, r in sglang_releases.supported().items()}
    assert [v for v, o in table.items() if o is None] == ["0.5.10", "0.5.10.post1", "0.5.11"]
    assert table["0.5.12"] == table["0.5.12.post1"] == ()  # its MLA drafter reads no EAGLE 3.1 option
    assert all(table[v] == ("fc_norm", "norm_output") for v in sglang_releases.supported() if v >= "0.5.13")
    assert sglang_releases.mla_drafter_releases()[0] == "0.5.12"
    assert sglang_releases.mla_drafter_releases(["fc_norm"])[0] == "0.5.13"


def test_eagle31_options_of_an_mla_drafter_follow_the_mla_class_not_the_llama_one():
    """0.5.12's llama_eagle3.py reads fc_norm; its kimi_k25_eagle3.py does not."""
    assert load_profile("micro", overrides={"drafter": {"fc_norm": True}, "gpu_host": {"sglang_version": "0.5.12"}})
    with pytest.raises(ProfileError, match=r"drafter\.fc_norm: gpu_host\.sglang_version 0\.5\.12 does not read it"):
        load_profile(
            "micro",
            overrides={"drafter": {"attention": "mla", "fc_norm": True}, "gpu_host": {"sglang_version": "0.5.12"}},
        )


def test_aux_layers_are_checked_against_the_releases_that_serve_an_mla_drafter():
    """micro's [1, 2, 3]: 0.5.12 captures them from [0, 1, 2], 0.5.13+ from no draft config."""
    with pytest.raises(ProfileError, match=r"hidden\.aux_layers: .*drafter\.attention: mla: .* 0\.5\.12 to 0\.5\.23"):
        load_profile("micro", overrides={"drafter": {"attention": "mla"}})
    assert load_profile("micro", overrides={"drafter": {"attention": "mla"}, "hidden": {"aux_layers": [2, 3, 4]}})


def test_mla_sizes_default_to_the_targets_and_each_is_overridable(tmp_path):
    arch = TargetArch.from_dir(_tiny_target(tmp_path))
    cfg = DrafterConfig.from_profile(
        DrafterOverrides(attention="mla"), arch, draft_vocab_size=256, aux_layers=(1, 2, 3), serving_context=4096
    )
    assert (
        cfg.attention,
        cfg.num_attention_heads,
        cfg.q_lora_rank,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    ) == ("mla", 2, 32, 16, 8, 8, 16)
    assert cfg.rope_theta == 50_000.0 and cfg.rope_interleave
    assert cfg.rope_scaling["type"] == "yarn" and cfg.rope_scaling["factor"] == 1.0  # the target's (SGLang's CPU RoPE)
    assert cfg.kv_values_per_token() == 16 + 8
    mine = DrafterOverrides(
        attention="mla",
        num_attention_heads=4,
        q_lora_rank=24,
        kv_lora_rank=12,
        qk_nope_head_dim=4,
        qk_rope_head_dim=6,
        v_head_dim=10,
        hidden_size=48,
    )
    cfg = DrafterConfig.from_profile(mine, arch, draft_vocab_size=256, aux_layers=(1, 2, 3), serving_context=4096)
    assert (
        cfg.num_attention_heads,
        cfg.q_lora_rank,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.hidden_size,
        cfg.target_hidden_size,
    ) == (4, 24, 12, 4, 6, 10, 48, 64)
    gqa = DrafterConfig.from_profile(
        DrafterOverrides(), arch, draft_vocab_size=256, aux_layers=(1, 2, 3), serving_context=4096
    )
    assert gqa.attention == "gqa" and gqa.rope_scaling is None
    assert gqa.kv_values_per_token() == 2 * gqa.num_key_value_heads * gqa.head_dim


def test_a_target_without_mla_and_no_sizes_is_refused_naming_the_field(tmp_path):
    arch = TargetArch.from_dir(_llama_target(tmp_path))
    with pytest.raises(ValueError, match=r"drafter\.q_lora_rank: the target's config\.json has no q_lora_rank"):
        DrafterConfig.from_profile(
            DrafterOverrides(attention="mla"), arch, draft_vocab_size=256, aux_layers=(1, 2, 3), serving_context=4096
        )
    given = DrafterOverrides(
        attention="mla", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16
    )
    cfg = DrafterConfig.from_profile(given, arch, draft_vocab_size=256, aux_layers=(1, 2, 3), serving_context=4096)
    assert cfg.num_attention_heads == 4 and cfg.rope_scaling is None and cfg.rope_theta == 500000.0


def test_a_target_rope_scaling_the_mla_layer_cannot_build_is_refused(tmp_path):
    raw = json.loads((_tiny_target(tmp_path) / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"rope_scaling type 'llama3'"):
        DrafterConfig.from_profile(
            DrafterOverrides(attention="mla"),
            TargetArch.from_dir(tmp_path),
            draft_vocab_size=256,
            aux_layers=(1, 2, 3),
            serving_context=4096,
        )
