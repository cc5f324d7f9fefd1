"""Drafters trained elsewhere: a standard EAGLE-3 export read the way SGLang would serve it.

Owns reading an SGLang-loadable `LlamaForCausalLMEagle3` directory that lacks this
project's own config fields (`eagle3_dagster_aux_layers_canonical`,
`eagle3_dagster_sglang`), so the benchmark can compare a drafter trained by another
tool against ours on the same target and prompts. The project's own exports keep
their strict reading (`export.read_export`); `load_drafter` dispatches on the fields.

What SpecForge writes (specforge 0.2.0, `specforge/export/to_sglang.py` and
`to_hf.py`): `model.save_pretrained(...)` of its `LlamaForCausalLMEagle3`, so
config.json is the `LlamaConfig` built from the draft config the user trained with
(`eagle_config` only if that file had one: its llama3-8B config has none, its
DeepSeek-V3 config has `[1, 29, 57]`), and the weights carry the trainer's names,
which are SGLang's (`fc`, `midlayer.*`, `norm`, `lm_head`, `t2d`, `d2t`). `--to sglang`
drops every `embed` key; `--to hf` ships `embed_tokens.weight`. transformers 5 writes
RoPE under `rope_parameters` (SpecForge mirrors `rope_theta` to the top level).

The decisions, each as SGLang 0.5.23 makes them and each recorded as a note:
- aux layers: `eagle_config.eagle_aux_hidden_state_layer_ids` go through the serving
  release's `set_eagle3_layers_to_capture` rule for the target's family
  (`sglang.releases`); without ids (`model_runner_components/spec_aux_hidden_state.py`
  falls back to None) the target captures `[2, L//2, L-3]` (canonical) of its own
  L layers, in `deepseek_v2.py` and `llama.py` alike. vLLM's top-level ids are
  not read by SGLang for capture; where they disagree, a note says so.
- `embed_tokens.weight`: SGLang replaces the draft's embedding with the target's
  (`eagle_worker_v2.py`, `set_embed`); so does this loader, after comparing the two.
- `t2d`: SGLang skips it and maps draft ids by `d2t` (`llama_eagle3.py` load_weights);
  a `t2d` that disagrees with `d2t` is rebuilt from `d2t`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3_dagster import layers
from eagle3_dagster.drafter.export import ExportCheck, _sglang_dims, eagle31_options, expected_shapes, load_own_drafter
from eagle3_dagster.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_dagster.sglang import releases

# The release whose loader the defaults follow when the profile names none (the newest supported).
REFERENCE_SGLANG = "0.5.23"
OWN_FIELD = "eagle3_dagster_aux_layers_canonical"
# Variants this drafter does not implement: loading them as plain EAGLE-3 would silently draft garbage.
_UNSUPPORTED_CONFIG = ("norm_before_fc", "num_aux_hidden_states")
_UNSUPPORTED_WEIGHT_PREFIXES = ("input_norm.", "layers.1.", "midlayer.1.")
# SGLang's load_weights renames these legacy EAGLE 3.1 names (llama_eagle3.py, legacy_name_map)
_LEGACY_NAMES = {"aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.", "aux_norm_high.": "fc_norm.2."}


@dataclass
class ImportedDrafter:
    """A drafter ready for the benchmark, with how it was read."""

    model: Eagle3Drafter
    source: str  # "eagle3_dagster" (our export) or "external"
    aux_layers: tuple[int, ...]  # canonical
    aux_layers_from: str  # "eagle3_dagster config", "eagle_config ids via SGLang X", "SGLang X default"
    notes: list[str] = field(default_factory=list)

    def metadata(self) -> dict:
        return {"drafter_source": self.source, "drafter_aux_layers": list(self.aux_layers),
                "drafter_aux_layers_from": self.aux_layers_from, "drafter_notes": list(self.notes)}


def is_own_export(export_dir: Path) -> bool:
    cfg = json.loads((Path(export_dir) / "config.json").read_text())
    return OWN_FIELD in cfg


def sglang_default_aux_layers(num_target_layers: int) -> list[int]:
    """What SGLang's `set_eagle3_layers_to_capture(None)` captures (canonical): `[2, L//2, L-3]`."""
    return layers.default_aux_layers(num_target_layers)


def _target_facts(target_dir: Path) -> tuple[str, dict]:
    from eagle3_dagster.target import load_target_config

    raw = json.loads((Path(target_dir) / "config.json").read_text())
    arch = (raw.get("architectures") or load_target_config(target_dir).get("architectures") or ["unknown"])[0]
    return arch, load_target_config(target_dir)


def resolve_aux_layers(cfg: dict, target_architecture: str, num_target_layers: int,
                       sglang_version: str = REFERENCE_SGLANG) -> tuple[list[int], str, list[str]]:
    """(canonical aux layers, where they came from, notes) for an external export, as `sglang_version` serves it."""
    family = releases.arch_family(target_architecture)
    rule = releases.release(sglang_version).aux_id_rules[family]
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    notes = []
    if ids:
        canonical = releases.captured_layers(rule, [int(i) for i in ids])
        origin = f"eagle_config ids {list(ids)} via SGLang {sglang_version} ({family}: {rule})"
    else:
        canonical = sglang_default_aux_layers(num_target_layers)
        origin = f"SGLang {sglang_version} default for a {num_target_layers}-layer target"
        notes.append(f"config.json has no eagle_config.eagle_aux_hidden_state_layer_ids: aux layers default to "
                     f"{canonical} (canonical, [2, L//2, L-3]) as SGLang {sglang_version}'s "
                     f"set_eagle3_layers_to_capture(None) captures them")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if top is not None and list(top) != list(canonical):
        notes.append(f"top-level eagle_aux_hidden_state_layer_ids {list(top)} (vLLM's, canonical numbering) differ "
                     f"from the {canonical} SGLang captures; measured with SGLang's")
    if len(canonical) != 3 or sorted(set(canonical)) != canonical or not 0 <= canonical[0] <= canonical[-1] < \
            num_target_layers:
        raise ValueError(f"aux layers {canonical} ({origin}) are not 3 distinct increasing layers of a "
                         f"{num_target_layers}-layer target; write eagle_config.eagle_aux_hidden_state_layer_ids "
                         "into the drafter's config.json")
    return canonical, origin, notes


def _full_config(raw: dict) -> dict:
    """config.json with transformers' `LlamaConfig` defaults filled in, as SGLang reads it.

    A config written by hand, or by a `save_pretrained` that keeps only what differs from the class
    defaults, may leave out `intermediate_size` or `tie_word_embeddings` and still mean the default.
    """
    from transformers import LlamaConfig

    full = LlamaConfig.from_dict(dict(raw)).to_dict()
    full.update({k: v for k, v in raw.items() if k not in full})
    return full


def _config_errors(cfg: dict, target: dict) -> list[str]:
    errors = []
    for key, want in (("architectures", ["LlamaForCausalLMEagle3"]), ("num_hidden_layers", 1),
                      ("tie_word_embeddings", False)):
        if cfg.get(key) != want:
            errors.append(f"config.json {key}={cfg.get(key)!r}, an EAGLE-3 drafter has {want!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        errors.append(f"config.json hidden_act={cfg['hidden_act']!r}; the drafter's MLP is SiLU")
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key) or {}
        kind = rope.get("rope_type") or rope.get("type")
        if kind not in (None, "default"):
            errors.append(f"config.json {key} type {kind!r}: the in-process drafter implements plain RoPE only")
    eagle = cfg.get("eagle_config") or {}
    for key in _UNSUPPORTED_CONFIG:
        if cfg.get(key) or eagle.get(key):
            errors.append(f"config.json sets {key}: a variant this benchmark's drafter does not implement")
    dims = _sglang_dims(cfg)
    for ours, theirs in (("target_hidden_size", "hidden_size"), ("hidden_size", "hidden_size"),
                         ("vocab_size", "vocab_size")):
        if dims[ours] != int(target[theirs]):
            errors.append(f"config.json {ours}={dims[ours]}, the target's {theirs} is {target[theirs]}")
    return errors


def _read_weights(export_dir: Path) -> dict[str, torch.Tensor]:
    from eagle3_dagster.drafter.target_head import _weight_map

    if not list(export_dir.glob("*.safetensors")):
        found = sorted(p.name for p in export_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        raise FileNotFoundError(f"{export_dir}: no *.safetensors weights" + (f" (found {found}; re-export with "
                                                                             "safetensors)" if found else ""))
    state = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in _weight_map(export_dir).items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as h:
            state.update({n: h.get_tensor(n) for n in names})
    return state


def load_external_drafter(export_dir: Path, target_dir: Path, *,
                          sglang_version: str | None = None) -> ImportedDrafter:
    """Read a standard EAGLE-3 export (e.g. SpecForge's `export --to sglang` or `--to hf`) for the target."""
    from eagle3_dagster.drafter.target_head import load_target_tensors

    export_dir, target_dir = Path(export_dir), Path(target_dir)
    version = sglang_version or REFERENCE_SGLANG
    cfg = _full_config(json.loads((export_dir / "config.json").read_text()))
    arch, target = _target_facts(target_dir)
    check = ExportCheck(config_errors=_config_errors(cfg, target))
    check.raise_for_errors()
    aux, origin, notes = resolve_aux_layers(cfg, arch, int(target["num_hidden_layers"]), version)
    state = _read_weights(export_dir)
    for legacy, name in _LEGACY_NAMES.items():
        state = {k.replace(legacy, name): v for k, v in state.items()}
    options = eagle31_options(cfg)
    if unread := [o for o in options if o not in releases.release(version).eagle31_options]:
        raise ValueError(f"{export_dir}: config.json turns on {', '.join(unread)}, which SGLang {version} does not "
                         "read: it would serve this drafter without them")
    unsupported = sorted(k for k in state if k.startswith(_UNSUPPORTED_WEIGHT_PREFIXES))
    if unsupported:
        raise ValueError(f"{export_dir}: weights {unsupported} belong to a variant this benchmark's drafter does "
                         "not implement")
    embed = load_target_tensors(target_dir, want=("embed",)).embed.float()
    theirs = state.pop("embed_tokens.weight", None)
    if theirs is not None:
        if tuple(theirs.shape) != tuple(embed.shape):
            raise ValueError(f"{export_dir}: embed_tokens.weight has shape {tuple(theirs.shape)}, the target's "
                             f"embedding {tuple(embed.shape)}")
        diff = float((theirs.float() - embed).abs().max())
        same = "equals the target's" if diff == 0 else f"differs from the target's by up to {diff:.3g}"
        notes.append(f"embed_tokens.weight in the export {same}; SGLang serves the draft with the target's "
                     "embedding (set_embed) and so does this benchmark")
    want = expected_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in state.items()}
    check.missing = sorted(set(want) - set(got))
    check.unexpected = sorted(set(got) - set(want))
    check.misshaped = {k: (got[k], want[k]) for k in sorted(set(got) & set(want)) if got[k] != want[k]}
    check.non_finite = {k: int((~torch.isfinite(v)).sum()) for k, v in state.items()
                        if v.is_floating_point() and not bool(torch.isfinite(v).all())}
    check.raise_for_errors()
    dims = _sglang_dims(cfg)
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    dcfg = DrafterConfig(
        target_hidden_size=dims["target_hidden_size"], hidden_size=dims["hidden_size"],
        intermediate_size=dims["intermediate_size"], num_attention_heads=dims["num_attention_heads"],
        num_key_value_heads=dims["num_key_value_heads"], head_dim=dims["head_dim"], vocab_size=dims["vocab_size"],
        draft_vocab_size=dims["draft_vocab_size"], rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope), max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        aux_layers=tuple(aux), **{o: True for o in options},
    )
    d2t = state["d2t"].to(torch.int64)
    hot = torch.arange(dcfg.draft_vocab_size) + d2t
    if bool((hot < 0).any() or (hot >= dcfg.vocab_size).any()) or not bool((hot[1:] > hot[:-1]).all()):
        raise ValueError(f"{export_dir}: d2t does not map the draft vocabulary to ascending target ids")
    t2d = torch.zeros(dcfg.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    if not torch.equal(state["t2d"].to(torch.bool), t2d):
        notes.append("t2d disagrees with d2t; SGLang ignores t2d and maps draft ids by d2t, so t2d was rebuilt "
                     "from d2t")
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    state["t2d"], state["d2t"] = t2d, d2t
    model = Eagle3Drafter(dcfg, embed, d2t, t2d)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(f"{export_dir}: export does not match the drafter (missing {missing}, unexpected {unexpected})")
    return ImportedDrafter(model.eval(), "external", tuple(aux), origin, notes)


def load_drafter(export_dir: Path, target_dir: Path) -> Eagle3Drafter:
    """Rebuild the drafter from an SGLang-layout export plus the target's embedding.

    This project's exports are read strictly; a standard EAGLE-3 export without the project's
    fields (another trainer's) is read as SGLang serves it. It lives here, not in export.py, so
    that the two modules do not import each other."""
    return load_any_drafter(export_dir, target_dir).model


def load_any_drafter(export_dir: Path, target_dir: Path, *, sglang_version: str | None = None) -> ImportedDrafter:
    """This project's export (strict) or another trainer's (as SGLang serves it), with how it was read."""
    if is_own_export(export_dir):
        model = load_own_drafter(export_dir, target_dir)
        return ImportedDrafter(model, "eagle3_dagster", tuple(model.cfg.aux_layers), "eagle3_dagster export config")
    return load_external_drafter(export_dir, target_dir, sglang_version=sglang_version)
