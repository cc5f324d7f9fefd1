"""Drafter directories in the layout SpecForge writes, built with this project's code (no SpecForge code).

What SpecForge 0.2.0 does (`specforge/export/to_sglang.py`, `to_hf.py`, `checkpoint_io.py`):
the draft config JSON the user trained with goes through `AutoDraftModelConfig.from_file`
(`tie_word_embeddings` forced False, `draft_vocab_size` defaulting to `vocab_size`) into a
transformers `LlamaConfig`; the model is materialized in bfloat16 and written with
`save_pretrained` (config.json = that LlamaConfig, weights = model.safetensors under the
trainer's names); `apply_legacy_rope_scaling` then mirrors `rope_parameters.rope_theta` to a
top-level `rope_theta`. `--to sglang` keeps every key without "embed"; `--to hf` keeps
`embed_tokens.weight` too. The trainer's names for LlamaForCausalLMEagle3 are this
project's export names (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter


def draft_config(drafter, *, eagle_aux_ids: list[int] | None = None, **extra) -> dict:
    """A SpecForge draft config for the drafter's shape, as a user writes one (like its llama3-8B config)."""
    c = drafter.cfg
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
    }
    if c.target_hidden_size != c.hidden_size:
        cfg["target_hidden_size"] = c.target_hidden_size
    if eagle_aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(eagle_aux_ids), "use_aux_hidden_state": True}
    return cfg | extra


def write_specforge_export(
    drafter,
    out: Path,
    config: dict,
    *,
    to: str = "sglang",
    embed: torch.Tensor | None = None,
    extra_weights: dict | None = None,
) -> Path:
    """`specforge export --to sglang|hf` of `drafter` (weights rounded to bfloat16, as SpecForge materializes)."""
    from transformers import LlamaConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = dict(config)
    raw["tie_word_embeddings"] = False
    raw.setdefault("draft_vocab_size", raw.get("vocab_size"))
    llama = LlamaConfig.from_dict(raw)
    llama.architectures = ["LlamaForCausalLMEagle3"]
    llama.dtype = torch.bfloat16
    llama.save_pretrained(str(out))
    path = out / "config.json"
    written = json.loads(path.read_text())
    theta = (written.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and written.get("rope_theta") != theta:  # apply_legacy_rope_scaling
        written["rope_theta"] = theta
        path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    state = {
        k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()
        for k, v in drafter.state_dict().items()
    }
    if to == "sglang":
        state = {k: v for k, v in state.items() if "embed" not in k.lower()}
    elif to == "hf":
        if embed is not None:
            state["embed_tokens.weight"] = embed.detach()  # read from the target as it is stored there
    else:
        raise ValueError(f"to must be 'sglang' or 'hf', got {to!r}")
    state.update(extra_weights or {})
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_target_head(d: Path, *, vocab: int, hidden: int, layers: int) -> Path:
    """A DeepSeek-V3 target folder with its config and its embedding and LM head only: all that loading a drafter
    exported elsewhere reads of a target."""
    d.mkdir()
    torch.manual_seed(1)
    save_file(
        {"model.embed_tokens.weight": torch.randn(vocab, hidden), "lm_head.weight": torch.randn(vocab, hidden)},
        str(d / "model.safetensors"),
    )
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "hidden_size": hidden,
                "intermediate_size": 32,
                "vocab_size": vocab,
                "num_hidden_layers": layers,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000.0,
                "max_position_embeddings": 512,
            }
        )
    )
    return d


def small_drafter(embed: torch.Tensor, *, draft_vocab: int, aux_layers=(2, 4, 5)) -> Eagle3Drafter:
    """A 4-head drafter over the target `embed` (vocab x hidden) with every `vocab // draft_vocab`-th token in its
    draft vocabulary, seeded: the drafter another trainer exported, in the import tests."""
    vocab, hidden = embed.shape
    cfg = DrafterConfig(
        target_hidden_size=hidden,
        hidden_size=hidden,
        intermediate_size=24,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        max_position_embeddings=512,
        aux_layers=aux_layers,
    )
    ids = torch.arange(0, vocab, vocab // draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    torch.manual_seed(0)
    return Eagle3Drafter(cfg, embed, ids - torch.arange(draft_vocab), t2d).eval()
