"""The MLA drafter export SGLang 0.5.23's `Eagle3DeepseekV2ForCausalLM` loads, its key-by-key check, and reading
another trainer's MLA drafter (kimi-k2.5-eagle3-mla's layout) into the benchmark.

SGLang's own `load_weights` (the source of the release wheel, `sglang/srt/models/kimi_k25_eagle3.py`) is run
on the export against the parameter names its modules define: every weight must land, none may be skipped.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import typing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_dagster.drafter.export import check_export, export_drafter, read_export
from eagle3_dagster.drafter.imported import load_any_drafter
from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_dagster.drafter.target_head import load_target_tensors

V, H, T_H, DV, L = 40, 16, 16, 10, 61
YARN = {
    "type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}  # Kimi-K2.5's
SGLANG_MLA_NAMES = {  # what Eagle3DeepseekV2ForCausalLM's modules register (kimi_k25_eagle3.py, deepseek_v2.py)
    "model.embed_tokens.weight": (V, H),
    "model.fc.weight": (H, 3 * T_H),
    "model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight": (10 + 8 + 6, 2 * H),  # q_lora + kv_lora + rope
    "model.midlayer.self_attn.q_a_layernorm.weight": (10,),
    "model.midlayer.self_attn.q_b_proj.weight": (3 * (4 + 6), 10),
    "model.midlayer.self_attn.kv_a_layernorm.weight": (8,),
    "model.midlayer.self_attn.kv_b_proj.weight": (3 * (4 + 5), 8),
    "model.midlayer.self_attn.o_proj.weight": (H, 3 * 5),
    "model.midlayer.mlp.gate_up_proj.weight": (2 * 24, H),
    "model.midlayer.mlp.down_proj.weight": (H, 24),
    "model.midlayer.input_layernorm.weight": (H,),
    "model.midlayer.hidden_norm.weight": (H,),
    "model.midlayer.post_attention_layernorm.weight": (H,),
    "model.norm.weight": (H,),
    "lm_head.weight": (DV, H),
}


@pytest.fixture
def target_dir(tmp_path: Path) -> Path:
    """A Kimi-K2.5-shaped target: config under text_config with MLA sizes and yarn, its embedding."""
    d = tmp_path / "target"
    d.mkdir()
    torch.manual_seed(1)
    save_file(
        {
            "language_model.model.embed_tokens.weight": torch.randn(V, H),
            "language_model.lm_head.weight": torch.randn(V, H),
        },
        str(d / "model.safetensors"),
    )
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["KimiK25ForConditionalGeneration"],
                "text_config": {
                    "architectures": ["DeepseekV3ForCausalLM"],
                    "hidden_size": H,
                    "intermediate_size": 24,
                    "vocab_size": V,
                    "num_hidden_layers": L,
                    "rms_norm_eps": 1e-6,
                    "rope_theta": 50000.0,
                    "max_position_embeddings": 262144,
                    "num_attention_heads": 3,
                    "q_lora_rank": 10,
                    "kv_lora_rank": 8,
                    "qk_nope_head_dim": 4,
                    "qk_rope_head_dim": 6,
                    "v_head_dim": 5,
                    "rope_scaling": YARN,
                },
            }
        )
    )
    return d


def mla_drafter(target_dir: Path, **extra) -> Eagle3Drafter:
    from eagle3_dagster.config import DrafterOverrides
    from eagle3_dagster.drafter.target_head import TargetArch

    cfg = DrafterConfig.from_profile(
        DrafterOverrides(attention="mla", **extra),
        TargetArch.from_dir(target_dir),
        draft_vocab_size=DV,
        aux_layers=(2, 30, 58),
        serving_context=262144,
    )
    ids = torch.arange(0, V, V // DV)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg, load_target_tensors(target_dir, ("embed",)).embed, ids - torch.arange(DV), t2d)
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.2)
    return model.eval()


def _same_outputs(a: Eagle3Drafter, b: Eagle3Drafter) -> bool:
    ids, hidden = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(5)), torch.randn(1, 7, H)
    pos = torch.arange(7)[None] + 5000  # past yarn's original context
    with torch.no_grad():
        return all(torch.equal(x, y) for x, y in zip(a.step(ids, hidden, pos), b.step(ids, hidden, pos)))


def test_the_export_is_a_deepseek_v3_config_with_sglangs_mla_names_and_shapes(tmp_path, target_dir):
    model = mla_drafter(target_dir)
    export = export_drafter(
        model,
        tmp_path / "export",
        serving_context=262144,
        dtype=torch.float32,
        target_architecture="KimiK25ForConditionalGeneration",
    )
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    assert (
        cfg["q_lora_rank"],
        cfg["kv_lora_rank"],
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
        cfg["num_attention_heads"],
    ) == (10, 8, 4, 6, 5, 3)
    assert cfg["rope_scaling"] == YARN and cfg["rope_theta"] == 50000.0 and cfg["rope_interleave"] is True
    assert cfg["max_position_embeddings"] == 262144 and cfg["num_hidden_layers"] == 1
    # aux ids by each release's rule, as the GQA export: [1, 29, 57] is right on every MLA-serving release
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]  # vLLM's (canonical)
    assert cfg["eagle3_dagster_sglang"]["releases"][0] == "0.5.12"  # none before: no MLA drafter class
    weights = load_file(str(export / "model.safetensors"))
    assert not any(k.startswith(("midlayer.", "embed_tokens")) for k in weights)
    assert {k for k in weights if k.startswith("layers.0.self_attn.")} == {
        f"layers.0.self_attn.{n}.weight"
        for n in (
            "q_a_proj",
            "q_a_layernorm",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_a_layernorm",
            "kv_b_proj",
            "o_proj",
        )
    }
    assert check_export(export).ok
    dcfg, state = read_export(export)
    assert dcfg == model.cfg
    back = Eagle3Drafter(dcfg, model.embed_tokens.weight, state["d2t"], state["t2d"])
    back.load_state_dict(state, strict=False)
    assert _same_outputs(model, back.eval())
    from transformers import AutoConfig  # what SGLang and vLLM parse config.json with

    parsed = AutoConfig.from_pretrained(export)
    assert type(parsed).__name__ == "DeepseekV3Config" and parsed.q_lora_rank == 10 and parsed.rope_interleave
    assert parsed.rope_parameters["rope_type"] == "yarn" and parsed.rope_parameters["rope_theta"] == 50000.0


def _sglang_load_weights(version: str = "0.5.23"):
    """`Eagle3DeepseekV2ForCausalLM.load_weights` compiled from the release's own source."""
    from tests.sglang_wheels import read_file

    source = read_file(version, "sglang/srt/models/kimi_k25_eagle3.py")
    cls = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.ClassDef) and n.name == "Eagle3DeepseekV2ForCausalLM"
    )
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights")
    namespace = {
        "torch": torch,
        "re": re,
        "Iterable": typing.Iterable,
        "Tuple": typing.Tuple,
        "logger": logging.getLogger("sglang-load-weights"),
        "default_weight_loader": lambda param, w: param.load(w),
    }
    exec(compile(ast.Module(body=[method], type_ignores=[]), "kimi_k25_eagle3.py", "exec"), namespace)
    return namespace["load_weights"]


class _Param:
    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape, self.loaded = name, shape, {}

    def load(self, w: torch.Tensor, shard=None) -> None:
        self.loaded[shard] = w

    def weight_loader(self, param, w, shard=None) -> None:
        param.load(w, shard)


class _SGLangDrafter:
    def __init__(self, names: dict) -> None:
        self.params = {n: _Param(n, s) for n, s in names.items()}
        self.hot_token_id = None

    def named_parameters(self):
        return self.params.items()

    def post_load_weights(self) -> None:
        pass


def test_sglangs_own_loader_takes_every_weight_of_the_export_and_leaves_no_parameter_unloaded(
    tmp_path, target_dir, caplog
):
    model = mla_drafter(target_dir)
    export = export_drafter(model, tmp_path / "export", serving_context=4096, dtype=torch.float32)
    weights = load_file(str(export / "model.safetensors"))
    sglang = _SGLangDrafter(SGLANG_MLA_NAMES)
    with caplog.at_level(logging.WARNING, logger="sglang-load-weights"):
        _sglang_load_weights()(sglang, iter(weights.items()))
    assert not [r.message for r in caplog.records]  # "Eagle3 MLA: skipping unexpected weight ..."
    # the embedding is the target's: SGLang's set_embed replaces the draft's (target_hidden_size == hidden_size)
    assert [n for n, p in sglang.params.items() if not p.loaded] == ["model.embed_tokens.weight"]
    a = "model.midlayer.self_attn."
    fused = sglang.params[a + "fused_qkv_a_proj_with_mqa.weight"].loaded[None]
    assert torch.equal(
        fused,
        torch.cat(
            [weights["layers.0.self_attn.q_a_proj.weight"], weights["layers.0.self_attn.kv_a_proj_with_mqa.weight"]]
        ),
    )
    for name, p in ((n, p) for n, p in sglang.params.items() if p.loaded):
        got = torch.cat([p.loaded[k] for k in sorted(p.loaded, key=lambda k: -1 if k is None else k)])
        assert tuple(got.shape) == p.shape, name
    assert torch.equal(sglang.hot_token_id, torch.arange(0, V, V // DV))  # d2t + arange


def test_check_export_finds_each_thing_sglang_would_load_wrongly_or_skip(tmp_path, target_dir):
    export = export_drafter(mla_drafter(target_dir), tmp_path / "export", serving_context=4096, dtype=torch.float32)
    weights, cfg = load_file(str(export / "model.safetensors")), json.loads((export / "config.json").read_text())

    def check(weights=weights, **config):
        out = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        out.mkdir()
        save_file(weights, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({**cfg, **config}))
        return check_export(out)

    no_kv_b = {k: v for k, v in weights.items() if k != "layers.0.self_attn.kv_b_proj.weight"}
    assert check(no_kv_b).missing == ["layers.0.self_attn.kv_b_proj.weight"]
    wrong = dict(weights, **{"layers.0.self_attn.q_b_proj.weight": torch.zeros(30, 9)})
    assert check(wrong).misshaped == {"layers.0.self_attn.q_b_proj.weight": ((30, 9), (30, 10))}
    assert list(check(v_head_dim=6).misshaped) == [
        "layers.0.self_attn.kv_b_proj.weight",
        "layers.0.self_attn.o_proj.weight",
    ]
    result = check(q_lora_rank=None)
    assert any("q_lora_rank" in e for e in result.config_errors)
    result = check(eagle3_dagster_sglang={**cfg["eagle3_dagster_sglang"], "releases": ["0.5.11"]})
    assert any("SGLang 0.5.11 cannot load an MLA drafter" in e for e in result.config_errors)
    assert any("model_type" in e for e in check(model_type="llama").config_errors)


def test_an_mla_export_for_a_release_without_the_mla_class_is_refused_naming_it(tmp_path, target_dir):
    model = mla_drafter(target_dir)
    with pytest.raises(ValueError, match=r"drafter\.attention: mla: SGLang 0\.5\.11 cannot load an MLA drafter"):
        export_drafter(model, tmp_path / "e", serving_context=4096, sglang_versions=["0.5.11"])
    with pytest.raises(ValueError, match=r"SGLang 0\.5\.12 does not read fc_norm"):  # its MLA class reads no option
        export_drafter(
            mla_drafter(target_dir, fc_norm=True), tmp_path / "f", serving_context=4096, sglang_versions=["0.5.12"]
        )
    cfg = json.loads(
        (
            export_drafter(mla_drafter(target_dir, fc_norm=True), tmp_path / "g", serving_context=4096) / "config.json"
        ).read_text()
    )
    assert cfg["fc_norm"] is True and cfg["eagle3_dagster_sglang"]["releases"][0] == "0.5.13"


def write_kimi_mla_checkpoint(out: Path, tensors: dict[str, torch.Tensor], *, midlayer: bool = False) -> Path:
    """A drafter folder as lightseek's kimi-k2.5-eagle3-mla ships it: a kimi_k2 / DeepSeek-V3 config.json without
    this project's fields, weights under the names SGLang's load_weights maps (`layers.0.*`, or `midlayer.*`),
    the embedding included, bf16."""
    out.mkdir(parents=True)
    names = {
        k.replace("layers.0.", "midlayer.") if midlayer else k: v.to(torch.bfloat16) if v.is_floating_point() else v
        for k, v in tensors.items()
    }
    save_file(names, str(out / "model.safetensors"))
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Eagle3DeepseekV2ForCausalLM"],
                "model_type": "kimi_k2",
                "num_hidden_layers": 1,
                "hidden_size": H,
                "intermediate_size": 24,
                "num_attention_heads": 3,
                "num_key_value_heads": 3,
                "q_lora_rank": 10,
                "kv_lora_rank": 8,
                "qk_nope_head_dim": 4,
                "qk_rope_head_dim": 6,
                "v_head_dim": 5,
                "hidden_act": "silu",
                "rms_norm_eps": 1e-6,
                "rope_theta": 50000.0,
                "rope_scaling": YARN,
                "max_position_embeddings": 262144,
                "vocab_size": V,
                "draft_vocab_size": DV,
                "tie_word_embeddings": False,
                "torch_dtype": "bfloat16",
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True},
            }
        )
    )
    return out


def _kimi_tensors(embed: torch.Tensor) -> dict[str, torch.Tensor]:
    """Random weights by the checkpoint's names and sizes (not from this project's module)."""
    g = torch.Generator().manual_seed(7)
    shapes = {
        "fc.weight": (H, 3 * T_H),
        "norm.weight": (H,),
        "lm_head.weight": (DV, H),
        "layers.0.self_attn.q_a_proj.weight": (10, 2 * H),
        "layers.0.self_attn.q_a_layernorm.weight": (10,),
        "layers.0.self_attn.q_b_proj.weight": (30, 10),
        "layers.0.self_attn.kv_a_proj_with_mqa.weight": (14, 2 * H),
        "layers.0.self_attn.kv_a_layernorm.weight": (8,),
        "layers.0.self_attn.kv_b_proj.weight": (27, 8),
        "layers.0.self_attn.o_proj.weight": (H, 15),
        "layers.0.mlp.gate_proj.weight": (24, H),
        "layers.0.mlp.up_proj.weight": (24, H),
        "layers.0.mlp.down_proj.weight": (H, 24),
        "layers.0.input_layernorm.weight": (H,),
        "layers.0.hidden_norm.weight": (H,),
        "layers.0.post_attention_layernorm.weight": (H,),
    }
    tensors = {k: (1.0 if "norm" in k else 0.0) + 0.2 * torch.randn(s, generator=g) for k, s in shapes.items()}
    ids = torch.arange(0, V, V // DV)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return tensors | {"d2t": ids - torch.arange(DV), "t2d": t2d, "embed_tokens.weight": embed}


@pytest.mark.parametrize("midlayer", [False, True], ids=["layers.0", "midlayer"])
def test_a_kimi_mla_drafter_from_elsewhere_loads_as_sglang_serves_it(tmp_path, target_dir, midlayer):
    embed = load_target_tensors(target_dir, ("embed",)).embed
    tensors = _kimi_tensors(embed)
    folder = write_kimi_mla_checkpoint(tmp_path / "kimi-mla", tensors, midlayer=midlayer)
    got = load_any_drafter(folder, target_dir)
    assert got.source == "external" and got.aux_layers == (2, 30, 58)
    assert "via SGLang 0.5.23" in got.aux_layers_from
    assert any("embed_tokens.weight in the export" in n for n in got.notes)
    cfg = got.model.cfg
    assert (cfg.attention, cfg.kv_lora_rank, cfg.rope_scaling["factor"], cfg.rope_interleave) == ("mla", 8, 64.0, True)
    assert cfg.kv_values_per_token() == 8 + 6
    # the same weights by name, in this project's module: identical drafting
    want = Eagle3Drafter(cfg, embed.float(), tensors["d2t"], tensors["t2d"])
    state = {
        ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): (
            v.to(torch.bfloat16).float() if v.is_floating_point() else v
        )
        for k, v in tensors.items()
        if k != "embed_tokens.weight"
    }
    want.load_state_dict(state, strict=False)
    assert _same_outputs(got.model, want.eval())


def test_a_kimi_mla_drafter_is_refused_for_a_release_that_cannot_serve_it(tmp_path, target_dir):
    folder = write_kimi_mla_checkpoint(
        tmp_path / "kimi-mla", _kimi_tensors(load_target_tensors(target_dir, ("embed",)).embed)
    )
    with pytest.raises(ValueError, match=r"SGLang 0\.5\.11 cannot load an MLA drafter"):
        load_any_drafter(folder, target_dir, sglang_version="0.5.11")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "rope_scaling": {"type": "linear", "factor": 8.0}}))
    with pytest.raises(ValueError, match=r"RoPE type 'linear'"):
        load_any_drafter(folder, target_dir)
