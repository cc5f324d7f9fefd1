"""The SGLang/vLLM export: exact names and shapes, layer numbering, and a faithful reload."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_dagster.drafter.export import SGLANG_EAGLE3_WEIGHTS, check_export, export_drafter
from eagle3_dagster.drafter.imported import load_drafter
from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_dagster.drafter.target_head import load_target_tensors
from eagle3_dagster.stages.bench import BenchSettings

V, H, DV = 40, 16, 10


@pytest.fixture
def target_dir(tmp_path: Path) -> Path:
    """A sharded, Kimi-style checkpoint (`language_model.` prefix, config under text_config)."""
    d = tmp_path / "target"
    d.mkdir()
    torch.manual_seed(1)
    tensors = {
        "language_model.model.embed_tokens.weight": torch.randn(V, H),
        "language_model.lm_head.weight": torch.randn(V, H),
        "language_model.model.norm.weight": torch.ones(H),
    }
    save_file({k: tensors[k] for k in list(tensors)[:1]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in list(tensors)[1:]}, str(d / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {k: f"model-0000{1 if i == 0 else 2}-of-00002.safetensors" for i, k in enumerate(tensors)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["KimiK25ForConditionalGeneration"],
                "text_config": {
                    "hidden_size": H,
                    "intermediate_size": 32,
                    "vocab_size": V,
                    "num_hidden_layers": 61,
                    "rms_norm_eps": 1e-6,
                    "rope_theta": 50000.0,
                    "max_position_embeddings": 262144,
                },
            }
        )
    )
    return d


def _drafter(target_dir: Path) -> Eagle3Drafter:
    cfg = DrafterConfig(
        target_hidden_size=H,
        hidden_size=H,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        vocab_size=V,
        draft_vocab_size=DV,
        aux_layers=(2, 30, 58),
    )
    ids = torch.arange(0, 40, 4)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    torch.manual_seed(0)
    model = Eagle3Drafter(cfg, load_target_tensors(target_dir, ("embed",)).embed, ids - torch.arange(DV), t2d)
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.2)
    return model


def test_target_head_reads_only_named_tensors_from_sharded_kimi_checkpoint(target_dir):
    t = load_target_tensors(target_dir)
    assert t.embed.shape == (V, H) and t.lm_head.shape == (V, H) and t.norm.shape == (H,)
    assert t.arch.num_hidden_layers == 61 and t.arch.rope_theta == 50000.0
    assert load_target_tensors(target_dir, ("embed",)).lm_head is None


def test_export_has_exactly_the_sglang_names_and_shapes_and_no_embeddings(tmp_path, target_dir):
    out = export_drafter(_drafter(target_dir), tmp_path / "export", serving_context=131072, dtype=torch.bfloat16)
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(SGLANG_EAGLE3_WEIGHTS)
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert weights["fc.weight"].dtype == torch.bfloat16
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["max_position_embeddings"] == 131072 and cfg["tie_word_embeddings"] is False
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (V, DV, H)
    assert check_export(out).ok


def test_export_writes_aux_layers_in_sglang_and_vllm_numbering(tmp_path, target_dir):
    cfg = json.loads((export_drafter(_drafter(target_dir), tmp_path / "e", 4096) / "config.json").read_text())
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]  # vLLM: input numbering
    assert cfg["eagle3_dagster_aux_layers_canonical"] == [2, 30, 58]


def test_check_export_reports_missing_extra_and_misshaped_keys(tmp_path, target_dir):
    out = export_drafter(_drafter(target_dir), tmp_path / "e", 4096, dtype=torch.float32)
    w = load_file(str(out / "model.safetensors"))
    w.pop("midlayer.hidden_norm.weight")
    w["layers.0.hidden_norm.weight"] = torch.ones(H)  # the silently-skipped pre-fix name
    w["fc.weight"] = torch.zeros(H, 2 * H)
    save_file(w, str(out / "model.safetensors"))
    result = check_export(out)
    assert result.missing == ["midlayer.hidden_norm.weight"]
    assert result.unexpected == ["layers.0.hidden_norm.weight"]
    assert result.misshaped == {"fc.weight": ((H, 2 * H), (H, 3 * H))}
    with pytest.raises(ValueError, match="LlamaForCausalLMEagle3"):
        result.raise_for_errors()


def test_reloaded_export_gives_identical_outputs(tmp_path, target_dir):
    model = _drafter(target_dir).eval()
    out = export_drafter(model, tmp_path / "e", 4096, dtype=torch.float32)
    reloaded = load_drafter(out, target_dir)
    assert reloaded.cfg == dataclasses.replace(model.cfg, max_position_embeddings=4096)  # raised to serving context
    ids, hidden = torch.randint(0, V, (1, 7)), torch.randn(1, 7, H)
    pos = torch.arange(7)[None]
    with torch.no_grad():
        for a, b in zip(model.step(ids, hidden, pos), reloaded.step(ids, hidden, pos)):
            assert torch.equal(a, b)


def test_an_eagle31_export_writes_its_options_and_norms_for_the_releases_that_read_them(tmp_path, target_dir):
    base = _drafter(target_dir)
    model = Eagle3Drafter(
        dataclasses.replace(base.cfg, fc_norm=True, norm_output=True), base.embed_tokens.weight, base.d2t, base.t2d
    )
    model.load_state_dict(base.state_dict(), strict=False)
    for i, norm in enumerate(model.fc_norm):
        norm.weight.data.fill_(0.5 + i)
    out = export_drafter(model.eval(), tmp_path / "e", 4096, dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    releases = cfg["eagle3_dagster_sglang"]["releases"]
    assert releases and "0.5.11" not in releases and "0.5.12" in releases  # 0.5.12 is the first that reads them
    assert set(load_file(str(out / "model.safetensors"))) == set(SGLANG_EAGLE3_WEIGHTS) | {
        f"fc_norm.{i}.weight" for i in range(3)
    }
    reloaded = load_drafter(out, target_dir)
    assert reloaded.cfg == dataclasses.replace(model.cfg, max_position_embeddings=4096)
    ids, pos, aux = torch.randint(0, V, (1, 7)), torch.arange(7)[None], torch.randn(1, 7, 3 * H)
    with torch.no_grad():
        assert torch.equal(model.project_aux(aux), reloaded.project_aux(aux))
        hidden = model.project_aux(aux)
        for a, b in zip(model.step(ids, hidden, pos), reloaded.step(ids, hidden, pos)):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"SGLang 0.5.11 does not read fc_norm, norm_output"):
        export_drafter(model, tmp_path / "old", 4096, sglang_versions=["0.5.11", "0.5.23"])
    # config.json edited to name a release that ignores the norms: the check says so
    cfg["eagle3_dagster_sglang"]["releases"].append("0.5.10")
    (out / "config.json").write_text(json.dumps(cfg))
    assert any("SGLang 0.5.10 does not read fc_norm, norm_output" in e for e in check_export(out).config_errors)
    cfg.pop("fc_norm")
    (out / "config.json").write_text(json.dumps(cfg))
    assert check_export(out).unexpected == [f"fc_norm.{i}.weight" for i in range(3)]  # SGLang would drop them


def test_a_profile_with_eagle31_options_for_a_release_that_ignores_them_is_refused_before_training():
    from eagle3_dagster.config import load_profile

    with pytest.raises(ValueError, match=r"drafter.fc_norm: gpu_host.sglang_version 0.5.11 does not read it"):
        load_profile("micro", overrides={"drafter": {"fc_norm": True}, "gpu_host": {"sglang_version": "0.5.11"}})
    assert load_profile(
        "micro", overrides={"drafter": {"fc_norm": True, "norm_output": True}, "gpu_host": {"sglang_version": "0.5.12"}}
    ).drafter.norm_output


def test_the_served_launch_refuses_an_export_whose_aux_ids_the_release_reads_one_layer_off(tmp_path, target_dir):
    """`serving_spec` itself, not only the stage's host check: the real-SGLang EAGLE-3 test called it directly and
    served a 0.5.12 export (eagle_config ids [0, 1, 2] for canonical [1, 2, 3]) on 0.5.23, which captured layers
    [0, 1, 2]; its acceptance then differed from the simulator's by exactly that."""
    from eagle3_dagster.bench.specdec import SpecConfig
    from eagle3_dagster.stages.bench import serving_spec

    from eagle3_dagster.config import load_profile

    profile = load_profile("micro")
    export = export_drafter(_drafter(target_dir), tmp_path / "export", serving_context=4096, sglang_versions=["0.5.12"])
    with pytest.raises(ValueError, match=r"SGLang 0\.5\.23, but the export .* right on SGLang 0\.5\.12 only"):
        serving_spec(BenchSettings.from_profile(profile), target_dir, export, "0.5.23", SpecConfig(3))
    assert (
        "--speculative-algorithm"
        in serving_spec(BenchSettings.from_profile(profile), target_dir, export, "0.5.12", SpecConfig(3)).extra_args
    )
    assert (
        serving_spec(BenchSettings.from_profile(profile), target_dir, export, "0.5.23", None).extra_args == ()
    )  # no drafter, nothing to read


def test_the_served_benchmark_runs_with_the_hosts_server_options(tmp_path, target_dir):
    """hidden.sglang_server_args are the GPU host's options (its device, memory fraction): the served benchmark
    launched SGLang without them, so a host that needs them (a CPU host: --device cpu) could extract but not serve
    the benchmark; the production rehearsal (tests/real_sglang/test_production_rehearsal.py) met it."""
    from eagle3_dagster.bench.specdec import SpecConfig
    from eagle3_dagster.config import load_profile
    from eagle3_dagster.stages.bench import serving_spec

    host_args = ["--device", "cpu", "--mem-fraction-static", "0.5"]
    profile = load_profile("micro", overrides={"hidden": {"sglang_server_args": host_args}})
    export = export_drafter(_drafter(target_dir), tmp_path / "export", serving_context=4096, sglang_versions=["0.5.12"])
    assert serving_spec(BenchSettings.from_profile(profile), target_dir, export, "0.5.12", None).extra_args == tuple(
        host_args
    )
    with_drafter = serving_spec(
        BenchSettings.from_profile(profile), target_dir, export, "0.5.12", SpecConfig(3)
    ).extra_args
    assert with_drafter[:2] == ("--speculative-algorithm", "EAGLE3") and with_drafter[-4:] == tuple(host_args)
