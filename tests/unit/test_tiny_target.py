"""The tiny target: real DeepSeek-V3 architecture, verified save/load, HF hidden-state convention, determinism."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3_dagster.io import sha256_file
from eagle3_dagster.storage import read_json
from eagle3_dagster.target import load_target_config, target_identity, target_summary
from eagle3_dagster.tiny.build import build_tiny_target, weights_digest
from eagle3_dagster.tiny.pretrain import downsample, pack_sequences


@pytest.fixture(scope="module")
def model(micro_target):
    return AutoModelForCausalLM.from_pretrained(str(micro_target), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sample_ids(micro_target):
    tok = AutoTokenizer.from_pretrained(str(micro_target))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "How do I sort a list in Python?"}], tokenize=False, add_generation_prompt=True
    )
    return torch.tensor([tok.encode(text, add_special_tokens=False)])


def test_saved_config_is_kimi_text_architecture_at_micro_size(micro_target, micro_profile):
    cfg = json.loads((micro_target / "config.json").read_text())
    tiny = micro_profile.target.tiny
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    assert (cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["first_k_dense_replace"]) == (
        tiny.q_lora_rank,
        tiny.kv_lora_rank,
        1,
    )
    assert (cfg["n_group"], cfg["topk_group"], cfg["num_nextn_predict_layers"]) == (1, 1, 0)
    assert cfg["tie_word_embeddings"] is False and cfg["vocab_size"] == tiny.vocab_size
    assert (micro_target / "model.safetensors").exists() and (micro_target / "generation_config.json").exists()
    # what SGLang reads directly to build the model (tests/real_sglang serve this target)
    assert (cfg["rope_parameters"]["rope_type"], cfg["rope_parameters"]["factor"]) == ("yarn", 1.0)
    assert (cfg["moe_layer_freq"], cfg["topk_method"], cfg["scoring_func"]) == (1, "noaux_tc", "sigmoid")


def test_yarn_rope_at_factor_one_is_the_plain_rope_bit_for_bit(micro_profile):
    """The tiny target writes DeepSeek yarn at factor 1.0 (SGLang's CPU path builds no other RoPE for
    DeepSeek); transformers must compute exactly what rope_type "default" computes."""
    from transformers import DeepseekV3ForCausalLM

    from eagle3_dagster.tiny.model import create_tiny_model, tiny_model_config

    config = tiny_model_config(
        micro_profile.target.tiny, vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    yarn = create_tiny_model(config, seed=0).eval()
    plain_config = tiny_model_config(
        micro_profile.target.tiny, vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    plain_config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    plain = DeepseekV3ForCausalLM(plain_config).float().eval()
    plain.load_state_dict(yarn.state_dict())
    ids = torch.randint(
        0, 512, (2, micro_profile.target.tiny.max_position_embeddings), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert torch.equal(yarn(ids).logits, plain(ids).logits)


def test_first_layer_is_dense_and_later_layers_route_tokens_to_several_experts(model, sample_ids):
    layers = model.model.layers
    assert type(layers[0].mlp).__name__ == "DeepseekV3MLP"
    assert all(type(layer.mlp).__name__ == "DeepseekV3MoE" for layer in layers[1:])
    chosen = []
    handle = layers[1].mlp.gate.register_forward_hook(lambda _m, _i, out: chosen.append(out[2]))
    with torch.no_grad():
        model(sample_ids)
    handle.remove()
    topk = chosen[0]
    assert topk.shape == (sample_ids.numel(), model.config.num_experts_per_tok)
    assert len(torch.unique(topk)) >= 2 and len({tuple(sorted(r.tolist())) for r in topk}) >= 2
    assert any(layer.mlp.gate.e_score_correction_bias.abs().sum() > 0 for layer in layers[1:])  # aux-free balancing ran


def test_hidden_states_are_l_plus_one_with_the_last_after_final_norm(model, sample_ids):
    captured = {}
    handle = model.model.norm.register_forward_hook(lambda _m, inp, out: captured.update(pre=inp[0], post=out))
    with torch.no_grad():
        out = model(sample_ids, output_hidden_states=True)
    handle.remove()
    hs = out.hidden_states
    assert len(hs) == model.config.num_hidden_layers + 1
    assert torch.equal(hs[0], model.model.embed_tokens(sample_ids))
    assert torch.equal(hs[-1], captured["post"]) and not torch.allclose(hs[-1], captured["pre"])
    assert torch.allclose(model.lm_head(hs[-1]), out.logits, atol=1e-6)


def test_save_and_load_give_identical_logits(model, sample_ids, tmp_path):
    model.save_pretrained(str(tmp_path))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(model(sample_ids).logits, again(sample_ids).logits)


def test_build_report_shows_the_model_learned_and_names_its_identity(micro_target, micro_profile):
    report = read_json(micro_target / "build_report.json")
    tiny = micro_profile.target.tiny
    assert report["tokens_seen"] >= tiny.pretrain_tokens
    assert report["final_loss"] < 0.75 * math.log(tiny.vocab_size)  # uniform guessing is log(V)
    assert report["final_loss"] < report["loss_curve"][0] - 1.0
    assert report["identity"] == target_identity(micro_target)
    assert report["tokenizer_vocab_size"] == tiny.vocab_size
    assert report["sharegpt_pretrain"]["heldout_skipped"] > 0  # held-out conversations were kept out
    assert (micro_target / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_build_is_deterministic_for_a_seed(micro_profile, tmp_path):
    # Two quick builds (a few hundred pre-training steps fewer than the micro target's: the same code, ~20 s of CPU
    # less), at one thread count: a float reduction split over another count rounds differently.
    quick = micro_profile.target.tiny.model_copy(update={"pretrain_tokens": 2000, "tokenizer_train_conversations": 50})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first, again = tmp_path / "first", tmp_path / "again"
        build_tiny_target(quick, first)
        build_tiny_target(quick, again)
    finally:
        torch.set_num_threads(threads)
    for name in ["model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"]:
        assert sha256_file(again / name) == sha256_file(first / name), name
    assert target_identity(again) == target_identity(first)


def test_failed_build_leaves_nothing_behind(micro_profile, tmp_path):
    bad = micro_profile.target.tiny.model_copy(update={"n_routed_experts": 1, "pretrain_tokens": 1000})
    with pytest.raises(ValueError, match="n_routed_experts"):
        build_tiny_target(bad, tmp_path / "target")
    assert list(tmp_path.iterdir()) == []


def test_rebuild_replaces_an_existing_target_directory(micro_profile, tmp_path):
    out = tmp_path / "target"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    quick = micro_profile.target.tiny.model_copy(update={"pretrain_tokens": 2000, "tokenizer_train_conversations": 50})
    messages = []
    build_tiny_target(quick, out, progress=messages.append)
    assert not (out / "stale.txt").exists() and (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["target"]
    assert any(m.startswith("pretrain: ") and " steps (" in m for m in messages) and "ready" in messages[-1]


def test_identity_of_a_rebuild_with_other_weights_differs(micro_target, micro_profile, tmp_path):
    other = micro_profile.target.tiny.model_copy(update={"pretrain_tokens": 2000, "tokenizer_train_conversations": 50})
    build_tiny_target(other, tmp_path / "target")
    assert (tmp_path / "target" / "config.json").read_text() != (micro_target / "config.json").read_text()
    assert target_identity(tmp_path / "target") != target_identity(micro_target)
    assert read_json(micro_target / "config.json")["weights_sha256"] == weights_digest(
        AutoModelForCausalLM.from_pretrained(str(micro_target), dtype=torch.float32)
    )


def test_identity_follows_config_and_weight_layout_not_location(micro_target, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(micro_target, copy)
    assert target_identity(copy) == target_identity(micro_target)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (copy / "config.json").write_text(json.dumps(cfg))
    assert target_identity(copy) != target_identity(micro_target)
    index = {"metadata": {"total_size": 1}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    (copy / "model.safetensors").unlink()  # with an index, weight files are never opened
    first = target_identity(copy)
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    assert target_identity(copy) != first


def test_kimi_k25_wrapper_config_yields_its_text_config(tmp_path):
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {
            "architectures": ["DeepseekV3ForCausalLM"],
            "num_hidden_layers": 61,
            "hidden_size": 7168,
            "vocab_size": 163840,
            "quantization_config": {"quant_method": "compressed-tensors"},
        },
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    assert load_target_config(tmp_path)["hidden_size"] == 7168
    assert target_summary(tmp_path) == {
        "num_layers": 61,
        "hidden_size": 7168,
        "vocab_size": 163840,
        "architecture": "KimiK25ForConditionalGeneration",
        "text_architecture": "DeepseekV3ForCausalLM",
        "dtype": "bfloat16",
        "quantization": "compressed-tensors",
    }


def test_summary_of_the_micro_target(micro_target, micro_profile):
    s = target_summary(micro_target)
    tiny = micro_profile.target.tiny
    assert (s["num_layers"], s["hidden_size"], s["vocab_size"]) == (
        tiny.num_hidden_layers,
        tiny.hidden_size,
        tiny.vocab_size,
    )
    assert s["architecture"] == "DeepseekV3ForCausalLM" and s["dtype"] == "float32"


def test_pack_sequences_cuts_concatenated_streams_and_cycles_when_short():
    packed = pack_sequences([[1, 2, 3], [4, 5]], seq_len=4, num_sequences=3)
    assert packed.tolist() == [[1, 2, 3, 4], [5, 1, 2, 3], [4, 5, 1, 2]]
    assert downsample([1.0, 3.0, 5.0, 7.0], 2) == [2.0, 6.0]
