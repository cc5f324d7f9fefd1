"""Drafters trained elsewhere load into the benchmark the way SGLang serves them (SpecForge's exports)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3_dagster.drafter.imported import load_drafter
from eagle3_dagster.drafter.imported import load_any_drafter, resolve_aux_layers
from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
from tests.specforge_format import draft_config, small_drafter, write_specforge_export, write_target_head
from eagle3_dagster.stages.bench import BenchSettings

V, H, DV, L = 48, 16, 12, 8


@pytest.fixture
def target_dir(tmp_path: Path) -> Path:
    """An 8-layer DeepSeek-V3 target's config and embedding (all the loader reads of a target)."""
    return write_target_head(tmp_path / "target", vocab=V, hidden=H, layers=L)


def _embed(target_dir: Path) -> torch.Tensor:
    from eagle3_dagster.drafter.target_head import load_target_tensors

    return load_target_tensors(target_dir, ("embed",)).embed


def _trained_elsewhere(target_dir: Path) -> Eagle3Drafter:
    model = small_drafter(_embed(target_dir), draft_vocab=DV)
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def _same_outputs(a: Eagle3Drafter, b: Eagle3Drafter) -> bool:
    ids, hidden = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(5)), torch.randn(1, 7, H)
    pos = torch.arange(7)[None]
    with torch.no_grad():
        return all(torch.equal(x, y) for x, y in zip(a.step(ids, hidden, pos), b.step(ids, hidden, pos)))


def _bf16_rounded(model: Eagle3Drafter) -> Eagle3Drafter:
    """What SpecForge's bfloat16 export holds of `model`, read back in float32."""
    out = Eagle3Drafter(model.cfg, model.embed_tokens.weight.detach(), model.d2t, model.t2d)
    out.load_state_dict(
        {
            k: v.to(torch.bfloat16).float() if v.is_floating_point() and k != "embed_tokens.weight" else v
            for k, v in model.state_dict().items()
        }
    )
    return out.eval()


def test_specforge_sglang_export_without_aux_ids_loads_with_sglang_default_layers_and_says_so(tmp_path, target_dir):
    drafter = _trained_elsewhere(target_dir)
    export = write_specforge_export(drafter, tmp_path / "sf", draft_config(drafter), to="sglang")
    assert "eagle_config" not in json.loads(
        (export / "config.json").read_text()
    )  # the KeyError SGLang raised on eagle_config

    got = load_any_drafter(export, target_dir)
    assert got.source == "external"
    # SGLang 0.5.23 set_eagle3_layers_to_capture(None): [2, L//2, L-3] of the target's 8 layers
    assert got.aux_layers == got.model.cfg.aux_layers == (2, 4, 5)
    assert "SGLang 0.5.23 default" in got.aux_layers_from
    assert any("no eagle_config" in n and "[2, 4, 5]" in n for n in got.notes)
    assert got.metadata()["drafter_aux_layers"] == [2, 4, 5]
    assert _same_outputs(got.model, _bf16_rounded(drafter))
    assert _same_outputs(load_drafter(export, target_dir), _bf16_rounded(drafter))  # the benchmark's entry point


def test_specforge_hf_export_embedding_is_compared_with_the_target_and_replaced_by_it(tmp_path, target_dir):
    drafter = _trained_elsewhere(target_dir)
    embed = _embed(target_dir)
    same = write_specforge_export(drafter, tmp_path / "same", draft_config(drafter), to="hf", embed=embed)
    got = load_any_drafter(same, target_dir)
    assert any("embed_tokens.weight in the export equals the target's" in n for n in got.notes)
    assert _same_outputs(got.model, _bf16_rounded(drafter))

    other = write_specforge_export(drafter, tmp_path / "other", draft_config(drafter), to="hf", embed=embed + 0.5)
    got = load_any_drafter(other, target_dir)
    assert any("differs from the target's by up to 0.5" in n for n in got.notes), got.notes
    assert torch.equal(got.model.embed_tokens.weight, embed.float())  # the target's, as SGLang's set_embed does

    wrong = write_specforge_export(drafter, tmp_path / "wrong", draft_config(drafter), to="hf", embed=embed[:-1])
    with pytest.raises(
        ValueError, match=r"embed_tokens.weight has shape \(47, 16\), the target's embedding \(48, 16\)"
    ):
        load_any_drafter(wrong, target_dir)


def test_eagle_config_ids_are_read_by_the_serving_release_rule_for_the_target_family():
    cfg = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}  # SpecForge's DeepSeek-V3 config
    assert resolve_aux_layers(cfg, "DeepseekV3ForCausalLM", 61, "0.5.23")[0] == [2, 30, 58]
    assert resolve_aux_layers(cfg, "DeepseekV3ForCausalLM", 61, "0.5.12")[0] == [2, 30, 58]
    canonical = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}
    assert resolve_aux_layers(canonical, "KimiK25ForConditionalGeneration", 61, "0.5.23")[0] == [2, 30, 58]
    assert resolve_aux_layers(canonical, "DeepseekV3ForCausalLM", 61, "0.5.12")[0] == [3, 31, 59]
    assert resolve_aux_layers(canonical, "LlamaForCausalLM", 61, "0.5.23")[0] == [3, 31, 59]
    aux, _, notes = resolve_aux_layers({}, "DeepseekV3ForCausalLM", 61)
    assert aux == [2, 30, 58] and len(notes) == 1
    vllm = resolve_aux_layers({"eagle_aux_hidden_state_layer_ids": [3, 30, 58]}, "DeepseekV3ForCausalLM", 61)[2]
    assert any("vLLM's" in n and "[3, 30, 58]" in n for n in vllm)
    with pytest.raises(ValueError, match=r"\[2, 2, 1\].*not 3 distinct increasing layers of a 4-layer target"):
        resolve_aux_layers({}, "DeepseekV3ForCausalLM", 4)


def test_variants_the_benchmark_drafter_does_not_implement_are_refused(tmp_path, target_dir):
    drafter = _trained_elsewhere(target_dir)
    llama3_rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rope = write_specforge_export(drafter, tmp_path / "rope", draft_config(drafter, rope_scaling=llama3_rope))
    with pytest.raises(ValueError, match=r"rope_.* type 'llama3'.*plain RoPE only"):
        load_any_drafter(rope, target_dir)
    norms = {f"fc_norm.{i}.weight": torch.ones(H, dtype=torch.bfloat16) for i in range(3)}
    # per-state norms whose config does not turn fc_norm on: SGLang would build no fc_norm and drop them
    fc_norm = write_specforge_export(drafter, tmp_path / "fc_norm", draft_config(drafter), extra_weights=norms)
    with pytest.raises(ValueError, match=r"unexpected=\['fc_norm.0.weight', 'fc_norm.1.weight', 'fc_norm.2.weight'\]"):
        load_any_drafter(fc_norm, target_dir)
    old = write_specforge_export(
        drafter, tmp_path / "old", draft_config(drafter) | {"fc_norm": True}, extra_weights=norms
    )
    with pytest.raises(ValueError, match=r"turns on fc_norm, which SGLang 0.5.11 does not read"):
        load_any_drafter(old, target_dir, sglang_version="0.5.11")
    other_target = write_specforge_export(drafter, tmp_path / "vocab", draft_config(drafter) | {"vocab_size": V + 1})
    with pytest.raises(ValueError, match=rf"vocab_size={V + 1}, the target's vocab_size is {V}"):
        load_any_drafter(other_target, target_dir)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(json.dumps(draft_config(drafter)))
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights \(found \['pytorch_model.bin'\]"):
        load_any_drafter(tmp_path / "bin", target_dir)


def test_a_t2d_that_disagrees_with_d2t_is_rebuilt_from_d2t_as_sglang_maps_by_d2t(tmp_path, target_dir):
    drafter = _trained_elsewhere(target_dir)
    export = write_specforge_export(
        drafter, tmp_path / "sf", draft_config(drafter), extra_weights={"t2d": torch.ones(V, dtype=torch.bool)}
    )  # SpecForge's init value
    got = load_any_drafter(export, target_dir)
    assert torch.equal(got.model.t2d, drafter.t2d) and any("t2d was rebuilt" in n for n in got.notes)


def test_benchmark_stage_measures_a_specforge_export_and_records_how_it_read_it(tmp_path, micro_target):
    """The micro target's canonical aux layers [1, 2, 3] are ids [0, 1, 2] on a release that always adds one."""
    import orjson

    from eagle3_dagster.config import load_profile
    from eagle3_dagster.contracts import ArtifactLayout
    from eagle3_dagster.drafter.target_head import load_target_tensors
    from eagle3_dagster.stages.bench import benchmark_stage

    profile = load_profile(
        "micro",
        overrides={
            "run_root": str(tmp_path / "run"),
            "target": {"kind": "external", "path": str(micro_target)},
            "hidden": {"root": str(tmp_path / "hs")},
            "gpu_host": {"sglang_version": "0.5.12"},
            "bench": {"spec_configs": [[2, 1, 3]], "num_prompts": 2, "max_new_tokens": 8},
        },
    )
    target = load_target_tensors(micro_target, ("embed",))
    a = target.arch
    cfg = DrafterConfig.for_target(
        target_hidden_size=a.hidden_size,
        target_intermediate_size=a.intermediate_size,
        vocab_size=a.vocab_size,
        draft_vocab_size=64,
        aux_layers=(1, 2, 3),
        num_attention_heads=2,
        rope_theta=a.rope_theta,
        max_position_embeddings=512,
    )
    t2d = torch.zeros(a.vocab_size, dtype=torch.bool)
    t2d[torch.arange(0, 128, 2)] = True
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, target.embed.float(), torch.arange(0, 128, 2) - torch.arange(64), t2d)
    export = write_specforge_export(
        drafter, tmp_path / "specforge", draft_config(drafter, eagle_aux_ids=[0, 1, 2]), to="hf", embed=target.embed
    )
    lines: list[str] = []
    report = benchmark_stage(
        BenchSettings.from_profile(profile),
        ArtifactLayout.from_profile(profile),
        export_dir=export,
        previous_results=None,
        run_id="sf",
        progress=lines.append,
        out_dir=tmp_path / "out",
    )
    meta = report.metadata
    assert meta["drafter_source"] == "external" and meta["drafter_aux_layers"] == [1, 2, 3]
    assert meta["drafter_aux_layers_from"] == "eagle_config ids [0, 1, 2] via SGLang 0.5.12 (deepseek: always_plus_one)"
    assert any("equals the target's" in line for line in lines)
    results = orjson.loads((tmp_path / "out" / "results-sf.json").read_bytes())
    assert results["meta"]["drafter_notes"] == meta["drafter_notes"]
    assert {r["method"] for r in results["rows"]} == {"no_spec", "eagle3", "eagle3_untrained", "ngram"}
    assert (tmp_path / "out" / "report.md").exists()


def test_an_eagle31_export_loads_with_its_norms_under_legacy_or_current_names(tmp_path, target_dir):
    """SGLang >= 0.5.12 builds `fc_norm` from config.json `fc_norm` (or `use_aux_norm`) and renames the legacy
    `aux_norm_low/mid/high` weights to `fc_norm.0/1/2`; `norm_output` changes what the next step gets."""
    plain = _trained_elsewhere(target_dir)
    want = Eagle3Drafter(
        DrafterConfig(**{**plain.cfg.__dict__, "fc_norm": True, "norm_output": True}),
        _embed(target_dir),
        plain.d2t,
        plain.t2d,
    )
    want.load_state_dict(plain.state_dict(), strict=False)
    for i, norm in enumerate(want.fc_norm):
        norm.weight.data = torch.linspace(0.5, 1.5, H).roll(i).to(torch.bfloat16).float()
    want = _bf16_rounded(want)
    norms = {f"fc_norm.{i}.weight": n.weight.detach().to(torch.bfloat16) for i, n in enumerate(want.fc_norm)}
    legacy = {f"aux_norm_{p}.weight": norms[f"fc_norm.{i}.weight"] for i, p in enumerate(("low", "mid", "high"))}
    for name, config, weights in (("current", {"fc_norm": True}, norms), ("legacy", {"use_aux_norm": True}, legacy)):
        export = write_specforge_export(
            plain, tmp_path / name, draft_config(plain) | config | {"norm_output": True}, extra_weights=weights
        )
        got = load_any_drafter(export, target_dir).model
        assert got.cfg.fc_norm and got.cfg.norm_output
        aux = torch.randn(1, 7, 3 * H) * 50
        assert torch.equal(got.project_aux(aux), want.project_aux(aux)) and _same_outputs(got, want), name
