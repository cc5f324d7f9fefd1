"""Aux-layer ids in the export, checked by running each supported release's own capture method.

`set_eagle3_layers_to_capture` is plain Python in every release: the tests take it from the wheel
(DeepseekV2ForCausalLM, KimiK25ForConditionalGeneration delegating to its DeepSeek language model,
LlamaForCausalLM), call it with the export's `eagle_config` ids and compare the layers it would
capture with the canonical layers the shards were extracted at.

A release whose method source is the same as its neighbours' captures as they do, so the method
runs at the first and last release of each stretch of one source (RUN_ON); one full-tier test reads
every release's source and fails when a new release starts a stretch RUN_ON does not name.
"""

from __future__ import annotations

import ast
from functools import cache
from types import SimpleNamespace

import pytest
import torch

from eagle3_dagster import sglang_releases
from eagle3_dagster.config import ProfileError, load_profile
from eagle3_dagster.drafter.export import _aux_id_errors, export_config
from eagle3_dagster.drafter.model import DrafterConfig
from tests import sglang_wheels

DEEPSEEK = "sglang/srt/models/deepseek_v2.py"
KIMI = "sglang/srt/models/kimi_k25.py"
LLAMA = "sglang/srt/models/llama.py"
# The `set_eagle3_layers_to_capture` methods each architecture's capture runs through.
CAPTURE_METHODS = {
    "KimiK25ForConditionalGeneration": [(KIMI, "KimiK25ForConditionalGeneration"), (DEEPSEEK, "DeepseekV2ForCausalLM")],
    "DeepseekV3ForCausalLM": [(DEEPSEEK, "DeepseekV2ForCausalLM")],
    "LlamaForCausalLM": [(LLAMA, "LlamaForCausalLM")],
}
# The first and last release of each stretch with one source of those methods: Kimi's own method
# changes at 0.5.11, DeepSeek's at 0.5.13 (always_plus_one -> plus_one_if_first_is_one), Llama's never.
RUN_ON = {
    "KimiK25ForConditionalGeneration": ["0.5.10", "0.5.10.post1", "0.5.11", "0.5.12.post1", "0.5.13", "0.5.23"],
    "DeepseekV3ForCausalLM": ["0.5.10", "0.5.12.post1", "0.5.13", "0.5.23"],
    "LlamaForCausalLM": ["0.5.10", "0.5.23"],
}
DEFAULT_AUX = {
    "KimiK25ForConditionalGeneration": (2, 30, 58),
    "DeepseekV3ForCausalLM": (2, 30, 58),
    "LlamaForCausalLM": (3, 16, 29),
}


def _config(aux: tuple[int, ...], arch: str, versions=None) -> dict:
    cfg = DrafterConfig(
        target_hidden_size=16,
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        vocab_size=40,
        draft_vocab_size=10,
        aux_layers=aux,
    )
    return export_config(cfg, 4096, torch.bfloat16, target_architecture=arch, sglang_versions=versions)


def _captured_by_release(version: str, arch: str, ids: list[int], num_layers: int = 61) -> list[int]:
    if arch == "LlamaForCausalLM":
        return sglang_wheels.run_set_eagle3_layers_to_capture(
            sglang_wheels.read_file(version, LLAMA), "LlamaForCausalLM", ids, num_layers
        )
    deepseek = sglang_wheels.read_file(version, DEEPSEEK)
    if arch == "DeepseekV3ForCausalLM":
        return sglang_wheels.run_set_eagle3_layers_to_capture(deepseek, "DeepseekV2ForCausalLM", ids, num_layers)
    # KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture, from its own source, over a language
    # model whose method is DeepSeek's from the same release
    kimi = sglang_wheels.read_file(version, KIMI)
    fn = sglang_wheels.find_method(kimi, "KimiK25ForConditionalGeneration", "set_eagle3_layers_to_capture")
    from typing import List, Optional

    ns = {"Optional": Optional, "List": List}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "<kimi>", "exec"), ns)
    captured = {}

    def language_model_method(layer_ids=None):
        captured["layers"] = sglang_wheels.run_set_eagle3_layers_to_capture(
            deepseek, "DeepseekV2ForCausalLM", layer_ids, num_layers
        )

    ns["set_eagle3_layers_to_capture"](
        SimpleNamespace(language_model=SimpleNamespace(set_eagle3_layers_to_capture=language_model_method)), ids
    )
    return captured["layers"]


@cache
def _method_source(version: str, path: str, cls: str) -> str:
    return ast.unparse(
        sglang_wheels.find_method(sglang_wheels.read_file(version, path), cls, "set_eagle3_layers_to_capture")
    )


def _stretch_ends(arch: str) -> list[str]:
    """The supported releases whose capture-method source differs from the previous or the next release's."""
    versions = list(sglang_releases.supported())
    sources = [tuple(_method_source(v, path, cls) for path, cls in CAPTURE_METHODS[arch]) for v in versions]
    return [
        v
        for i, v in enumerate(versions)
        if i in (0, len(versions) - 1) or sources[i] != sources[i - 1] or sources[i] != sources[i + 1]
    ]


@pytest.mark.slow  # parses three model files of every supported release (CI runs the full tier)
def test_the_releases_the_capture_runs_on_are_the_ends_of_each_stretch_of_one_method_source():
    assert {arch: _stretch_ends(arch) for arch in RUN_ON} == RUN_ON


@pytest.mark.parametrize("arch,version", [(arch, v) for arch, vs in RUN_ON.items() for v in vs])
def test_default_export_ids_capture_the_canonical_layers_on_every_release(arch, version):
    aux = DEFAULT_AUX[arch]
    cfg = _config(aux, arch)
    assert cfg["eagle3_dagster_sglang"]["releases"] == list(sglang_releases.supported())
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert _captured_by_release(version, arch, ids) == list(aux)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(aux)  # vLLM: input numbering
    assert _aux_id_errors(cfg) == []


@pytest.mark.parametrize("version", ["0.5.12.post1", "0.5.13"])  # the last of always_plus_one, the first after
def test_non_default_aux_layers_are_written_for_the_named_release(version):
    """[3, 30, 58] is `[2, 29, 57]` up to 0.5.12.post1 and `[3, 30, 58]` from 0.5.13: canonical - 1 was wrong there."""
    cfg = _config((3, 30, 58), "KimiK25ForConditionalGeneration", [version])
    assert _captured_by_release(
        version, "KimiK25ForConditionalGeneration", cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    ) == [3, 30, 58]
    assert cfg["eagle3_dagster_sglang"]["releases"] == [version]


def test_check_export_runs_the_rule_of_each_recorded_release_not_self_consistency():
    cfg = _config((3, 30, 58), "DeepseekV3ForCausalLM", ["0.5.23"])
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 29, 57]  # the old export: canonical - 1
    assert _captured_by_release("0.5.23", "DeepseekV3ForCausalLM", [2, 29, 57]) == [2, 29, 57]
    errors = _aux_id_errors(cfg)
    assert errors and "0.5.23 captures [2, 29, 57]" in errors[0]


def test_aux_set_no_named_release_can_express_is_refused_at_profile_load():
    with pytest.raises(ProfileError, match=r"hidden\.aux_layers.*0\.5\.23"):
        load_profile("production", {"hidden": {"aux_layers": [1, 30, 58]}, "gpu_host": {"sglang_version": "0.5.23"}})
    # canonical 1 is SGLang id 0, which only the releases that always add 1 can express
    assert load_profile(
        "production", {"hidden": {"aux_layers": [1, 30, 58]}, "gpu_host": {"sglang_version": "0.5.12"}}
    ).hidden.aux_layers == [1, 30, 58]
    assert _captured_by_release("0.5.12", "DeepseekV3ForCausalLM", [0, 29, 57]) == [1, 30, 58]
    with pytest.raises(ProfileError, match="gpu_host.sglang_version"):
        load_profile("production", {"gpu_host": {"sglang_version": "0.5.9"}})
