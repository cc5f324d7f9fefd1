"""The tiny target in Kimi-K2.5's checkpoint layout (`eagle3_dagster.tiny.kimi_k25`).

What SGLang's `KimiK25ForConditionalGeneration` reads from the folder (served for real in
tests/real_sglang/test_real_kimi_k25.py): the wrapper config with the text model's config under
`text_config`, the text weights bit for bit under `language_model.`, a vision tower and projector
under Kimi's names, and a processor that transformers' AutoProcessor loads as remote code.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoProcessor, AutoTokenizer

from eagle3_dagster.drafter.target_head import load_target_tensors
from eagle3_dagster.target import target_summary
from eagle3_dagster.tiny.kimi_k25 import TinyVision, wrap_as_kimi_k25


@pytest.fixture(scope="module")
def kimi(micro_target, tmp_path_factory):
    return wrap_as_kimi_k25(micro_target, tmp_path_factory.mktemp("kimi") / "kimi_k25")


def test_config_wraps_the_text_config_in_kimi_k25s_layout(kimi, micro_target):
    text = json.loads((micro_target / "config.json").read_text())
    cfg = json.loads((kimi / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    assert cfg["text_config"] == {k: v for k, v in text.items() if k != "transformers_version"}
    assert cfg["media_placeholder_token_id"] == text["vocab_size"]  # no text token is an image placeholder
    v = cfg["vision_config"]
    assert v["text_hidden_size"] == text["hidden_size"]
    assert (v["vt_hidden_size"], v["hidden_size"]) == (TinyVision.hidden_size,) * 2
    assert cfg["auto_map"] == {"AutoProcessor": "kimi_k25_processor.KimiK25Processor"}
    assert target_summary(kimi) == target_summary(micro_target) | {"architecture": "KimiK25ForConditionalGeneration"}


def test_text_weights_are_the_targets_bit_for_bit_under_language_model(kimi, micro_target):
    text = load_file(str(micro_target / "model.safetensors"))
    wrapped = load_file(str(kimi / "model.safetensors"))
    for name, t in text.items():
        assert torch.equal(wrapped[f"language_model.{name}"], t), name
    others = {n for n in wrapped if not n.startswith("language_model.")}
    assert others and all(n.startswith(("vision_tower.", "mm_projector.")) for n in others)
    # the names SGLang's load_weights maps (wqkv -> attn.qkv_proj, wo -> attn.proj, proj.0/2 -> linear_1/2)
    assert {
        "vision_tower.encoder.blocks.0.wqkv.weight",
        "vision_tower.encoder.blocks.0.wo.bias",
        "mm_projector.proj.0.weight",
        "mm_projector.proj.2.weight",
    } <= others
    assert wrapped["mm_projector.proj.2.weight"].shape == (text["lm_head.weight"].shape[1], 4 * TinyVision.hidden_size)
    head, wrapped_head = load_target_tensors(micro_target), load_target_tensors(kimi)
    assert torch.equal(head.embed, wrapped_head.embed) and torch.equal(head.lm_head, wrapped_head.lm_head)


def test_processor_loads_as_remote_code_with_the_targets_tokenizer_and_refuses_media(kimi, micro_target):
    proc = AutoProcessor.from_pretrained(str(kimi), trust_remote_code=True)
    assert type(proc).__name__ == "KimiK25Processor"
    assert set(proc.media_processor.media_proc_cfg) >= {
        "patch_size",
        "merge_kernel_size",
        "in_patch_limit",
        "patch_limit_on_one_side",
        "image_mean",
        "image_std",
    }
    text = "<|im_user|>user<|im_middle|>hello there<|im_end|>"
    want = AutoTokenizer.from_pretrained(str(micro_target)).encode(text, add_special_tokens=False)
    assert proc.tokenizer.encode(text, add_special_tokens=False) == want
    with pytest.raises(NotImplementedError, match="text only"):
        proc(text=text, images=[object()])


def test_refuses_a_folder_that_is_already_wrapped(kimi, tmp_path):
    with pytest.raises(ValueError, match="already a wrapped checkpoint"):
        wrap_as_kimi_k25(kimi, tmp_path / "again")
