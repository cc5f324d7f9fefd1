"""The drafter export SGLang and vLLM serve, and the key-by-key check of it.

Owns `config.json` + `model.safetensors` in the `LlamaForCausalLMEagle3`
layout (drafter.attention: gqa) or the `Eagle3DeepseekV2ForCausalLM` one (mla: its
names and config fields are in `mla_export.py`). SGLang ≤ 0.5.11 skips names it
does not know and never reports missing weights (a `layers.0.*` Llama export
starts fine and drafts garbage), so
`check_export` compares names and shapes with what SGLang's loader defines,
derived from config.json the way SGLang derives them.

Aux layer ids are written three ways: `eagle_config.eagle_aux_hidden_state_layer_ids`
for SGLang, a top-level `eagle_aux_hidden_state_layer_ids` in vLLM's (= canonical)
numbering, and `eagle3_dagster_aux_layers_canonical`. SGLang's ids are the ones that
the serving releases' own `set_eagle3_layers_to_capture` turns into the canonical
layers for the target's architecture (`eagle3_dagster.sglang_releases`: from 0.5.13
DeepSeek adds 1 only when the first id is 1); `eagle3_dagster_sglang` records the
target family and the releases they are right on, and `check_export` re-checks them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as save_safetensors

from eagle3_dagster import layers, sglang_releases
import eagle3_dagster.drafter.mla_export as mla_export
from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_dagster.io import atomic_write_bytes, atomic_write_json

WEIGHTS_FILE = "model.safetensors"

# The names SGLang's LlamaForCausalLMEagle3 / LlamaModel (num_hidden_layers = 1) load, read from
# sgl-project/sglang python/sglang/srt/models/llama_eagle3.py @ 03d5a777: `fc` (Linear 3·target_hidden_size
# → hidden_size, target_hidden_size defaulting to hidden_size), `midlayer` (LlamaDecoderLayer whose
# QKVParallelLinear takes 2·hidden_size; q/k/v and gate/up are stacked by load_weights), `norm`,
# `lm_head` (ParallelLMHead draft_vocab_size × hidden_size), `d2t` (→ hot_token_id) and `t2d` (skipped).
# Each shape is (rows, cols) as a function of the config fields below.
SGLANG_EAGLE3_WEIGHTS: dict[str, tuple[str, ...]] = {
    "fc.weight": ("hidden_size", "3*target_hidden_size"),
    "midlayer.self_attn.q_proj.weight": ("num_attention_heads*head_dim", "2*hidden_size"),
    "midlayer.self_attn.k_proj.weight": ("num_key_value_heads*head_dim", "2*hidden_size"),
    "midlayer.self_attn.v_proj.weight": ("num_key_value_heads*head_dim", "2*hidden_size"),
    "midlayer.self_attn.o_proj.weight": ("hidden_size", "num_attention_heads*head_dim"),
    "midlayer.mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
    "midlayer.mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
    "midlayer.mlp.down_proj.weight": ("hidden_size", "intermediate_size"),
    "midlayer.input_layernorm.weight": ("hidden_size",),
    "midlayer.hidden_norm.weight": ("hidden_size",),
    "midlayer.post_attention_layernorm.weight": ("hidden_size",),
    "norm.weight": ("hidden_size",),
    "lm_head.weight": ("draft_vocab_size", "hidden_size"),
    "d2t": ("draft_vocab_size",),
    "t2d": ("vocab_size",),
}


# EAGLE 3.1's per-state norms before `fc` (config.json `fc_norm`, or SGLang's legacy `use_aux_norm`): SGLang
# and vLLM build one RMSNorm of target_hidden_size per captured state, `fc_norm.{i}`.
FC_NORM_WEIGHTS: dict[str, tuple[str, ...]] = {f"fc_norm.{i}.weight": ("target_hidden_size",) for i in range(3)}


def eagle31_options(cfg: dict) -> list[str]:
    """The EAGLE 3.1 options a draft config.json turns on, as SGLang's llama_eagle3.py reads them."""
    return [
        o
        for o, on in (
            ("fc_norm", cfg.get("fc_norm") or cfg.get("use_aux_norm")),
            ("norm_output", cfg.get("norm_output")),
        )
        if on
    ]


def _sglang_dims(cfg: dict) -> dict[str, int]:
    """The sizes SGLang derives from config.json (LlamaAttention's head_dim default, target_hidden_size default;
    an MLA drafter's sizes, its head_dim the query/key head size)."""
    h = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    mla = mla_export.dims(cfg) if mla_export.is_mla(cfg) else {}
    head_dim = mla.get("qk_head_dim") or int(cfg.get("head_dim") or h // heads)
    dims = {
        "hidden_size": h,
        "target_hidden_size": int(cfg.get("target_hidden_size") or h),
        "num_attention_heads": heads,
        # MLA shares one latent across heads: its num_key_value_heads (transformers' default 128) means nothing
        "num_key_value_heads": heads if mla else int(cfg.get("num_key_value_heads") or heads),
        "head_dim": head_dim,
        "intermediate_size": int(cfg["intermediate_size"]),
        "vocab_size": int(cfg["vocab_size"]),
        "draft_vocab_size": int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
    }
    return dims | mla


def drafter_config(cfg: dict, aux_layers: Sequence[int]) -> DrafterConfig:
    """The drafter a draft config.json describes, read as SGLang reads it: the sizes `_sglang_dims` derives,
    LlamaConfig's defaults for a missing `rms_norm_eps` or `max_position_embeddings` (this project's exports
    write both), the RoPE base from `rope_theta` or transformers 5's `rope_parameters`, the EAGLE 3.1 options
    it turns on, and an MLA drafter's sizes and RoPE scaling. `aux_layers` are canonical."""
    from eagle3_dagster.drafter.target_head import rope_scaling

    dims = _sglang_dims(cfg)
    options = eagle31_options(cfg)
    mla = mla_export.is_mla(cfg)
    # a foreign config's RoPE base is checked > 0 where it is read (`imported.config_value_errors`)
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    return DrafterConfig(
        target_hidden_size=dims["target_hidden_size"],
        hidden_size=dims["hidden_size"],
        intermediate_size=dims["intermediate_size"],
        num_attention_heads=dims["num_attention_heads"],
        num_key_value_heads=dims["num_key_value_heads"],
        head_dim=dims["head_dim"],
        vocab_size=dims["vocab_size"],
        draft_vocab_size=dims["draft_vocab_size"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        aux_layers=tuple(aux_layers),
        fc_norm="fc_norm" in options,
        norm_output="norm_output" in options,
        attention="mla" if mla else "gqa",
        # a GQA drafter's dims have no MLA sizes: None, as DrafterConfig wants them
        q_lora_rank=dims.get("q_lora_rank"),
        kv_lora_rank=dims.get("kv_lora_rank"),
        qk_nope_head_dim=dims.get("qk_nope_head_dim"),
        qk_rope_head_dim=dims.get("qk_rope_head_dim"),
        v_head_dim=dims.get("v_head_dim"),
        rope_scaling=rope_scaling(cfg) if mla else None,
        rope_interleave=bool(cfg.get("rope_interleave", True)) if mla else True,
    )


def _eval_dim(expr: str, dims: dict[str, int]) -> int:
    value = 1
    for factor in expr.split("*"):
        value *= int(factor) if factor.isdigit() else dims[factor]
    return value


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    dims = _sglang_dims(config)
    layout = mla_export.WEIGHTS if mla_export.is_mla(config) else SGLANG_EAGLE3_WEIGHTS
    names = layout | (FC_NORM_WEIGHTS if "fc_norm" in eagle31_options(config) else {})
    return {name: tuple(_eval_dim(e, dims) for e in exprs) for name, exprs in names.items()}


def export_config(
    cfg: DrafterConfig,
    serving_context: int,
    dtype: torch.dtype,
    extra: dict | None = None,
    *,
    target_architecture: str = "DeepseekV3ForCausalLM",
    sglang_versions: list[str] | None = None,
) -> dict:
    canonical = list(cfg.aux_layers)
    family = sglang_releases.arch_family(target_architecture)
    options = [o for o in sglang_releases.EAGLE31_OPTIONS if getattr(cfg, o)]
    mla = cfg.attention == "mla"
    if (
        mla
        and sglang_versions
        and (why := [w for v in sglang_versions if (w := sglang_releases.mla_drafter_refusal(v))])
    ):
        raise ValueError(f"drafter.attention: mla: {'; '.join(why)}; the export would not be served")
    if mla and not sglang_versions:  # the releases that serve an MLA drafter (with its EAGLE 3.1 options)
        sglang_versions = sglang_releases.mla_drafter_releases(options)
    elif options and not sglang_versions:  # the releases that would serve the drafter as it was trained
        sglang_versions = [v for v, r in sglang_releases.supported().items() if set(options) <= set(r.eagle31_options)]
    sglang_ids, right_on = sglang_releases.draft_aux_ids(canonical, family, sglang_versions)
    if unread := _unread_options(options, right_on, cfg.attention):
        raise ValueError(
            f"drafter {', '.join(options)} (EAGLE 3.1): {unread}; a drafter trained with them would "
            "be served without them"
        )
    shape = (
        mla_export.config_fields(cfg)
        if mla
        else {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": cfg.hidden_size,
            "target_hidden_size": cfg.target_hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": None,
        }
    )
    return {
        **shape,
        # engines clamp RoPE at this length: it must cover the target's serving context (sglang #6783)
        "max_position_embeddings": max(serving_context, cfg.max_position_embeddings),
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": sglang_ids,
            "use_aux_hidden_state": True,
        },
        "eagle3_dagster_sglang": {
            "target_architecture": target_architecture,
            "target_family": family,
            "releases": right_on,
        },
        "eagle_aux_hidden_state_layer_ids": layers.canonical_to_vllm(canonical),
        "eagle3_dagster_aux_layers_canonical": canonical,
        "eagle3_dagster_aux_numbering": layers.CANONICAL_NUMBERING,
        **{o: True for o in options},
        **(extra or {}),
    }


def _unread_options(options: list[str], versions: list[str], attention: str = "gqa") -> str:
    """Which of `versions` would ignore which EAGLE 3.1 options ('' when every one reads them all)."""
    known = sglang_releases.supported()  # an unknown release is reported by the aux-id check
    unread = {v: [o for o in options if o not in known[v].drafter_options(attention)] for v in versions if v in known}
    return "; ".join(f"SGLang {v} does not read {', '.join(o)}" for v, o in unread.items() if o)


def export_drafter(
    model: Eagle3Drafter,
    out_dir: Path,
    serving_context: int,
    dtype: torch.dtype = torch.bfloat16,
    extra_config: dict | None = None,
    *,
    target_architecture: str = "DeepseekV3ForCausalLM",
    sglang_versions: list[str] | None = None,
) -> Path:
    """Write config.json + model.safetensors (atomically, weights first) and check the result."""
    if not model.cfg.aux_layers:
        raise ValueError("export_drafter: the drafter config has no aux_layers; SGLang would capture the wrong layers")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {}
    named = model.trainable_state_dict()
    for k, v in (mla_export.to_checkpoint(named) if model.cfg.attention == "mla" else named).items():
        v = v.detach().cpu()
        state[k] = (v.to(dtype) if v.is_floating_point() else v).contiguous()
    atomic_write_bytes(out_dir / WEIGHTS_FILE, save_safetensors(state, metadata={"format": "pt"}))
    cfg = export_config(
        model.cfg,
        serving_context,
        dtype,
        extra_config,
        target_architecture=target_architecture,
        sglang_versions=sglang_versions,
    )
    atomic_write_json(out_dir / "config.json", cfg)
    check_export(out_dir).raise_for_errors()
    return out_dir


@dataclass
class ExportCheck:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    misshaped: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)  # name → (got, want)
    config_errors: list[str] = field(default_factory=list)
    non_finite: dict[str, int] = field(default_factory=dict)  # name → how many NaN/inf values it holds

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.misshaped or self.config_errors or self.non_finite)

    def raise_for_errors(self) -> None:
        if not self.ok:
            raise ValueError(
                f"drafter export does not match what SGLang loads (LlamaForCausalLMEagle3 or "
                f"{mla_export.ARCHITECTURE}): {self}"
            )


def check_export(export_dir: Path) -> ExportCheck:
    """Compare the export's names, shapes and key config fields with what SGLang loads; every floating
    weight must be finite (a NaN drafter loads and serves without complaint, accepting nothing)."""
    export_dir = Path(export_dir)
    cfg = json.loads((export_dir / "config.json").read_text())
    result = ExportCheck()
    mla = mla_export.is_mla(cfg)
    want_layout = (
        (("architectures", [mla_export.ARCHITECTURE]), ("model_type", mla_export.MODEL_TYPE))
        if mla
        else (("architectures", ["LlamaForCausalLMEagle3"]),)
    )
    for key, want in (*want_layout, ("num_hidden_layers", 1), ("tie_word_embeddings", False)):
        if cfg.get(key) != want:
            result.config_errors.append(f"config.json {key}={cfg.get(key)!r}, SGLang needs {want!r}")
    served_by = (cfg.get("eagle3_dagster_sglang") or {}).get("releases", [])
    if mla:
        result.config_errors += mla_export.config_errors(cfg)
        result.config_errors += [
            f"config.json is an MLA drafter written for {w}"
            for v in served_by
            if v in sglang_releases.supported() and (w := sglang_releases.mla_drafter_refusal(v))
        ]
        if result.config_errors:
            return result  # the sizes the weights are checked against are not there
    result.config_errors += _aux_id_errors(cfg)
    if unread := _unread_options(eagle31_options(cfg), served_by, "mla" if mla else "gqa"):
        result.config_errors.append(f"config.json turns on {', '.join(eagle31_options(cfg))}: {unread}")
    want = expected_shapes(cfg)
    with safe_open(str(export_dir / WEIGHTS_FILE), framework="pt") as h:
        got = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}
        for k in sorted(got):
            tensor = h.get_tensor(k)
            if tensor.is_floating_point():
                bad = int((~torch.isfinite(tensor)).sum())
                if bad:
                    result.non_finite[k] = bad
    result.missing = sorted(set(want) - set(got))
    result.unexpected = sorted(set(got) - set(want))
    result.misshaped = {k: (got[k], want[k]) for k in sorted(set(got) & set(want)) if got[k] != want[k]}
    return result


def _aux_id_errors(cfg: dict) -> list[str]:
    """Run each recorded release's capture rule on the written ids: they must give the canonical layers."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    canonical = cfg.get("eagle3_dagster_aux_layers_canonical")
    sglang = cfg.get("eagle3_dagster_sglang")
    if canonical is None:
        return []
    if not sglang or not sglang.get("releases"):
        return [f"config.json records no SGLang release its aux ids {ids} were written for"]
    errors = []
    for version in sglang["releases"]:
        try:
            rule = sglang_releases.release(version).aux_id_rules[sglang["target_family"]]
        except (sglang_releases.UnsupportedRelease, KeyError) as e:
            errors.append(f"aux ids written for {version} / {sglang.get('target_family')}: {e}")
            continue
        got = sglang_releases.captured_layers(rule, list(ids or []))
        if got != list(canonical):
            errors.append(f"SGLang {version} captures {got} from eagle_config ids {ids}, not canonical {canonical}")
    return errors


def read_export(export_dir: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """The DrafterConfig and state dict of a checked export (fp32 floating tensors)."""
    check_export(export_dir).raise_for_errors()
    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    canonical = cfg.get("eagle3_dagster_aux_layers_canonical")
    if canonical is None:
        canonical = layers.sglang_to_canonical(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    dcfg = drafter_config(cfg, canonical)
    with safe_open(str(Path(export_dir) / WEIGHTS_FILE), framework="pt") as h:
        state = {k: h.get_tensor(k) for k in h.keys()}
    if dcfg.attention == "mla":
        state = mla_export.from_checkpoint(state)
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    return dcfg, state


def load_own_drafter(export_dir: Path, target_dir: Path) -> Eagle3Drafter:
    """`imported.load_drafter` for an export this project wrote (its aux layers and releases recorded)."""
    from eagle3_dagster.drafter.target_head import load_target_tensors

    cfg, state = read_export(Path(export_dir))
    embed = load_target_tensors(Path(target_dir), want=("embed",)).embed
    assert embed is not None  # asked for: a missing one raised
    model = Eagle3Drafter(cfg, embed.float(), state["d2t"], state["t2d"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(
            f"{export_dir}: export does not match the drafter (missing {missing}, unexpected {unexpected})"
        )
    return model.eval()
