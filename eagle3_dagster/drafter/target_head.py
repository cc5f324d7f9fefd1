"""The few target tensors the drafter needs, read straight from the target's safetensors.

Training needs the target's token embedding (the drafter's frozen input
embedding) and its lm_head (the teacher); the final norm is read for callers
that hold pre-norm hidden states. Loading the whole target for that would mean
~1 TB for Kimi-K2.5, so only those tensors are read, from single-file or
sharded (`*.safetensors.index.json`) checkpoints, under plain DeepSeek-V3
names (`model.embed_tokens.weight`) or Kimi-K2.5's multimodal wrapper
(`language_model.model.embed_tokens.weight`, config under `text_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3_dagster.safetensors_folder import weight_files

# Where DeepSeek-V3-family checkpoints put the text model, in order of preference.
PREFIXES = ("", "language_model.", "model.language_model.")
SUFFIXES = {
    "embed": "model.embed_tokens.weight",
    "lm_head": "lm_head.weight",
    "norm": "model.norm.weight",
}


@dataclass(frozen=True)
class TargetArch:
    """The target config fields the drafter and the export derive from."""

    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # what an MLA drafter (drafter.attention: mla) takes from a DeepSeek-V3 target; None where the target has no MLA
    num_attention_heads: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_scaling: dict | None = None  # the target's RoPE scaling (Kimi-K2.5: DeepSeek yarn); None: plain RoPE
    rope_interleave: bool = True  # DeepSeek's rotary pairs (2i, 2i+1), SGLang's and transformers' default

    @classmethod
    def from_dir(cls, target_dir: Path) -> "TargetArch":
        from eagle3_dagster.target import load_target_config  # the one reader of a target's config.json

        path = Path(target_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: target config not found")
        text = load_target_config(Path(target_dir))  # Kimi-K2.5's text_config, wrapper fields carried over
        try:
            return cls(
                hidden_size=int(text["hidden_size"]),
                intermediate_size=int(text["intermediate_size"]),
                vocab_size=int(text["vocab_size"]),
                num_hidden_layers=int(text["num_hidden_layers"]),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                rope_theta=float(
                    text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta", 10000.0)
                ),
                max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
                **{k: int(text[k]) for k in MLA_FIELDS if text.get(k) is not None},
                rope_scaling=rope_scaling(text),
                rope_interleave=bool(text.get("rope_interleave", True)),
            )
        except KeyError as e:
            raise ValueError(f"{path}: target config lacks field {e}") from None


MLA_FIELDS = (
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


def rope_scaling(text: dict) -> dict | None:
    """A config's RoPE scaling, from transformers 4's `rope_scaling` or 5's `rope_parameters`, without the base
    (`rope_theta`) and with its kind under `type`; None for plain RoPE."""
    raw = text.get("rope_scaling") or text.get("rope_parameters")
    if not isinstance(raw, dict):
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    return {"type": kind, **{k: v for k, v in raw.items() if k not in ("type", "rope_type", "rope_theta")}}


@dataclass(frozen=True)
class TargetTensors:
    arch: TargetArch
    embed: torch.Tensor | None  # [V, H]
    lm_head: torch.Tensor | None  # [V, H]
    norm: torch.Tensor | None  # [H]


def _find(weight_map: dict[str, Path], suffix: str) -> str | None:
    for prefix in PREFIXES:
        if prefix + suffix in weight_map:
            return prefix + suffix
    return None


def load_target_tensors(target_dir: Path, want: tuple[str, ...] = ("embed", "lm_head", "norm")) -> TargetTensors:
    """Read only the requested tensors (`embed`, `lm_head`, `norm`); a missing one is an error naming it."""
    target_dir = Path(target_dir)
    arch = TargetArch.from_dir(target_dir)
    weight_map = weight_files(target_dir, links_out=True)
    got: dict[str, torch.Tensor | None] = {k: None for k in SUFFIXES}
    for role in want:
        if role not in SUFFIXES:
            raise ValueError(f"unknown target tensor {role!r}; known: {sorted(SUFFIXES)}")
        name = _find(weight_map, SUFFIXES[role])
        if name is None and role == "lm_head" and arch.tie_word_embeddings:
            name = _find(weight_map, SUFFIXES["embed"])
        if name is None:
            tried = [p + SUFFIXES[role] for p in PREFIXES]
            raise KeyError(f"{target_dir}: target has no {role} tensor (tried {tried})")
        with safe_open(str(weight_map[name]), framework="pt") as h:
            got[role] = h.get_tensor(name)
    for role in ("embed", "lm_head"):
        t = got[role]
        if t is not None and tuple(t.shape) != (arch.vocab_size, arch.hidden_size):
            raise ValueError(
                f"{target_dir}: {role} has shape {tuple(t.shape)}, config says ({arch.vocab_size}, {arch.hidden_size})"
            )
    return TargetTensors(arch=arch, embed=got["embed"], lm_head=got["lm_head"], norm=got["norm"])
