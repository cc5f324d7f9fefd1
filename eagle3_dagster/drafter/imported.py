"""Drafters trained elsewhere: a standard EAGLE-3 export read the way SGLang would serve it.

Owns reading an SGLang-loadable `LlamaForCausalLMEagle3` directory, or an MLA drafter's
`Eagle3DeepseekV2ForCausalLM` one (lightseek's kimi-k2.5-eagle3-mla layout: a DeepSeek-V3
config.json, weights `layers.0.*` or `midlayer.*`, `mla_export.py`), that lacks this
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
  (`sglang_releases`); without ids (`model_runner_components/spec_aux_hidden_state.py`
  falls back to None) the target captures `[2, L//2, L-3]` (canonical) of its own
  L layers, in `deepseek_v2.py` and `llama.py` alike. vLLM's top-level ids are
  not read by SGLang for capture; where they disagree, a note says so.
- `embed_tokens.weight`: SGLang replaces the draft's embedding with the target's
  (`eagle_worker_v2.py`, `set_embed`); so does this loader, after comparing the two.
- `t2d`: SGLang skips it and maps draft ids by `d2t` (`llama_eagle3.py` load_weights);
  a `t2d` that disagrees with `d2t` is rebuilt from `d2t`.

The folder is foreign input, checked where it is read (`read_drafter_config`, `weight_files`), before
transformers or torch sees a value: every size a positive integer (not a bool, a float or a string) below
2**31, head sizes dividing, `rope_theta` and `rms_norm_eps` finite and positive (a NaN RoPE base loads,
drafts nothing and reports acceptance 1.0), the aux layers by the rule the profile's own follow
(`layers.validate_aux_layers`), and every weight file a regular file inside the folder (an index naming
`../other/model.safetensors` would measure another drafter under this one's name). A refusal is a
`ForeignInputError` naming the file and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3_dagster import layers, sglang_releases
import eagle3_dagster.drafter.mla_export as mla_export
from eagle3_dagster.drafter.export import (
    ExportCheck,
    _sglang_dims,
    drafter_config,
    eagle31_options,
    expected_shapes,
    load_own_drafter,
)
from eagle3_dagster.drafter.model import Eagle3Drafter
from eagle3_dagster.io import ForeignInputError, confined_path, regular_file
from eagle3_dagster.safetensors_folder import read_safetensors, weight_files

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
        return {
            "drafter_source": self.source,
            "drafter_aux_layers": list(self.aux_layers),
            "drafter_aux_layers_from": self.aux_layers_from,
            "drafter_notes": list(self.notes),
        }


# Sizes read from config.json: positive integers (a bool is not one: `true == 1` in Python), each below what
# any model's width, vocabulary or context reaches.
_SIZE_FIELDS = (
    "hidden_size",
    "target_hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "draft_vocab_size",
    "max_position_embeddings",
    "num_hidden_layers",
    *mla_export.MLA_DIMS,
)
MAX_SIZE = 2**31 - 1
_FLAG_FIELDS = (
    "tie_word_embeddings",
    "fc_norm",
    "norm_output",
    "use_aux_norm",
    "rope_interleave",
    *_UNSUPPORTED_CONFIG,
)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def config_value_errors(raw: dict) -> list[str]:
    """What is wrong with the values of a draft config.json, each naming its field (empty when nothing is).

    Only the fields given are checked (a missing or null one takes LlamaConfig's default, as SGLang reads it);
    sizes that must divide are checked against the defaults too."""
    errors = []
    for key in _SIZE_FIELDS:
        v = raw.get(key)
        if v is not None and not (_is_int(v) and 1 <= v <= MAX_SIZE):
            errors.append(f"{key}={v!r}: must be an integer from 1 to {MAX_SIZE}")
    for key in _FLAG_FIELDS:
        if raw.get(key) is not None and not isinstance(raw[key], bool):
            errors.append(f"{key}={raw[key]!r}: must be true or false")
    eps = raw.get("rms_norm_eps")
    if eps is not None and not (_is_number(eps) and math.isfinite(eps) and 0 < eps < 1):
        errors.append(f"rms_norm_eps={eps!r}: must be a finite number above 0 and below 1")
    for key in ("rope_scaling", "rope_parameters", "eagle_config"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            errors.append(f"{key}={raw[key]!r}: must be an object")
    thetas = {"rope_theta": raw.get("rope_theta")} | {
        f"{key}.rope_theta": raw[key].get("rope_theta")
        for key in ("rope_scaling", "rope_parameters")
        if isinstance(raw.get(key), dict)
    }
    for key, theta in thetas.items():
        if theta is not None and not (_is_number(theta) and math.isfinite(theta) and theta > 0):
            errors.append(f"{key}={theta!r}: the RoPE base must be a finite number above 0")
    eagle = raw["eagle_config"] if isinstance(raw.get("eagle_config"), dict) else {}
    for key, ids in (
        ("eagle_config.eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids")),
        ("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids")),
        (OWN_FIELD, raw.get(OWN_FIELD)),
    ):
        if ids is not None and not (isinstance(ids, list) and all(_is_int(i) and -1 <= i <= MAX_SIZE for i in ids)):
            errors.append(f"{key}={ids!r}: must be a list of layer numbers")
    if errors or mla_export.is_mla(raw):  # an MLA drafter's sizes: mla_export.config_errors, once defaults are in
        return errors
    hidden, heads = raw.get("hidden_size") or 4096, raw.get("num_attention_heads") or 32  # LlamaConfig's defaults
    if raw.get("head_dim") is None and hidden % heads:
        errors.append(
            f"num_attention_heads={heads} does not divide hidden_size={hidden} (config.json gives no head_dim)"
        )
    kv = raw.get("num_key_value_heads")
    if kv is not None and heads % kv:
        errors.append(f"num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    head_dim = raw.get("head_dim") or hidden // heads
    if head_dim % 2:
        errors.append(
            f"head_dim={head_dim}"
            + ("" if raw.get("head_dim") else " (hidden_size / num_attention_heads)")
            + ": RoPE needs an even head_dim"
        )
    draft, vocab = raw.get("draft_vocab_size"), raw.get("vocab_size")
    if draft is not None and vocab is not None and draft > vocab:
        errors.append(f"draft_vocab_size={draft} is larger than vocab_size={vocab}")
    return errors


def read_drafter_config(export_dir: Path) -> dict:
    """A drafter folder's config.json, as written (no defaults filled in), once its values are checked.

    Read with Python's json, as transformers reads it: `NaN` and `Infinity` parse, and are refused by name."""
    path = regular_file(confined_path(export_dir, "config.json", where=str(export_dir)), where=str(export_dir))
    try:
        raw = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ForeignInputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ForeignInputError(f"{path}: a JSON {type(raw).__name__}, not an object of config fields")
    if errors := config_value_errors(raw):
        raise ForeignInputError(f"{path}: " + "; ".join(errors))
    return raw


def is_own_export(export_dir: Path) -> bool:
    return OWN_FIELD in read_drafter_config(Path(export_dir))


def sglang_default_aux_layers(num_target_layers: int) -> list[int]:
    """What SGLang's `set_eagle3_layers_to_capture(None)` captures (canonical): `[2, L//2, L-3]`."""
    return layers.default_aux_layers(num_target_layers)


def _target_facts(target_dir: Path) -> tuple[str, dict]:
    from eagle3_dagster.target import load_target_config

    raw = json.loads((Path(target_dir) / "config.json").read_text())
    arch = (raw.get("architectures") or load_target_config(target_dir).get("architectures") or ["unknown"])[0]
    return arch, load_target_config(target_dir)


def resolve_aux_layers(
    cfg: dict, target_architecture: str, num_target_layers: int, sglang_version: str = REFERENCE_SGLANG
) -> tuple[list[int], str, list[str]]:
    """(canonical aux layers, where they came from, notes) for an external export, as `sglang_version` serves it."""
    family = sglang_releases.arch_family(target_architecture)
    rule = sglang_releases.release(sglang_version).aux_id_rules[family]
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    notes = []
    if ids:
        canonical = sglang_releases.captured_layers(rule, [int(i) for i in ids])
        origin = f"eagle_config ids {list(ids)} via SGLang {sglang_version} ({family}: {rule})"
    else:
        canonical = sglang_default_aux_layers(num_target_layers)
        origin = f"SGLang {sglang_version} default for a {num_target_layers}-layer target"
        notes.append(
            f"config.json has no eagle_config.eagle_aux_hidden_state_layer_ids: aux layers default to "
            f"{canonical} (canonical, [2, L//2, L-3]) as SGLang {sglang_version}'s "
            f"set_eagle3_layers_to_capture(None) captures them"
        )
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if top is not None and list(top) != list(canonical):
        notes.append(
            f"top-level eagle_aux_hidden_state_layer_ids {list(top)} (vLLM's, canonical numbering) differ "
            f"from the {canonical} SGLang captures; measured with SGLang's"
        )
    _check_aux_layers(canonical, origin, num_target_layers)
    return canonical, origin, notes


def _check_aux_layers(canonical: list[int], origin: str, num_target_layers: int) -> None:
    """The rule the profile's own hidden.aux_layers meet for the same target (`target.target_facts`)."""
    try:
        layers.validate_aux_layers(list(canonical), num_target_layers)
    except ValueError as e:
        raise ForeignInputError(
            f"aux layers {list(canonical)} ({origin}) are not 3 distinct increasing layers of a {num_target_layers}-"
            f"layer target as the profile's hidden.aux_layers must be: {str(e).removeprefix('hidden.aux_layers: ')}; "
            "write eagle_config.eagle_aux_hidden_state_layer_ids into the drafter's config.json"
        ) from None


def _full_config(raw: dict, path: Path | str = "config.json") -> dict:
    """config.json with transformers' `LlamaConfig` defaults filled in (`DeepseekV3Config`'s for an MLA
    drafter), as SGLang reads it.

    A config written by hand, or by a `save_pretrained` that keeps only what differs from the class
    defaults, may leave out `intermediate_size` or `tie_word_embeddings` and still mean the default.
    """
    from transformers import DeepseekV3Config, LlamaConfig

    kind = DeepseekV3Config if mla_export.is_mla(raw) else LlamaConfig
    try:
        full = kind.from_dict(dict(raw)).to_dict()
    except Exception as e:  # transformers' own validation (huggingface_hub's StrictDataclassError, not a ValueError)
        raise ForeignInputError(
            f"{path}: transformers' {kind.__name__} refuses it: " + " ".join(str(e).split())
        ) from None
    full.update({k: v for k, v in raw.items() if k not in full})
    return full


def _config_errors(cfg: dict, target: dict) -> list[str]:
    errors = []
    mla = mla_export.is_mla(cfg)
    if cfg.get("architectures") not in (["LlamaForCausalLMEagle3"], [mla_export.ARCHITECTURE]):
        errors.append(
            f"config.json architectures={cfg.get('architectures')!r}, an EAGLE-3 drafter has "
            f"['LlamaForCausalLMEagle3'] or [{mla_export.ARCHITECTURE!r}] (MLA)"
        )
    for key, want in (("num_hidden_layers", 1), ("tie_word_embeddings", False)):
        if cfg.get(key) != want:
            errors.append(f"config.json {key}={cfg.get(key)!r}, an EAGLE-3 drafter has {want!r}")
    if mla:
        errors += mla_export.config_errors(cfg)
    elif cfg.get("hidden_act", "silu") != "silu":
        errors.append(f"config.json hidden_act={cfg['hidden_act']!r}; the drafter's MLP is SiLU")
    for key in () if mla else ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key) or {}
        kind = rope.get("rope_type") or rope.get("type")
        if kind not in (None, "default"):
            errors.append(f"config.json {key} type {kind!r}: the in-process drafter implements plain RoPE only")
    eagle = cfg.get("eagle_config") or {}
    for key in _UNSUPPORTED_CONFIG:
        if cfg.get(key) or eagle.get(key):
            errors.append(f"config.json sets {key}: a variant this benchmark's drafter does not implement")
    dims = _sglang_dims(cfg)
    for ours, theirs in (
        ("target_hidden_size", "hidden_size"),
        ("hidden_size", "hidden_size"),
        ("vocab_size", "vocab_size"),
    ):
        if dims[ours] != int(target[theirs]):
            errors.append(f"config.json {ours}={dims[ours]}, the target's {theirs} is {target[theirs]}")
    return errors


def _read_weights(export_dir: Path) -> dict[str, torch.Tensor]:
    state = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in weight_files(export_dir).items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():

        def read(h, names=names, file=file):
            if missing := sorted(set(names) - set(h.keys())):
                raise ForeignInputError(f"{file}: has no tensor {missing[:3]} that the index puts there")
            return {n: h.get_tensor(n) for n in names}

        state.update(read_safetensors(file, read))
    return state


def load_external_drafter(export_dir: Path, target_dir: Path, *, sglang_version: str | None = None) -> ImportedDrafter:
    """Read a standard EAGLE-3 export (e.g. SpecForge's `export --to sglang` or `--to hf`) for the target."""
    from eagle3_dagster.drafter.target_head import load_target_tensors

    export_dir, target_dir = Path(export_dir), Path(target_dir)
    version = sglang_version or REFERENCE_SGLANG
    cfg = _full_config(read_drafter_config(export_dir), export_dir / "config.json")
    arch, target = _target_facts(target_dir)
    check = ExportCheck(config_errors=_config_errors(cfg, target))
    check.raise_for_errors()
    try:
        aux, origin, notes = resolve_aux_layers(cfg, arch, int(target["num_hidden_layers"]), version)
    except ForeignInputError as e:
        raise ForeignInputError(f"{export_dir / 'config.json'}: {e}") from None
    state = _read_weights(export_dir)
    for legacy, name in _LEGACY_NAMES.items():
        state = {k.replace(legacy, name): v for k, v in state.items()}
    options = eagle31_options(cfg)
    mla = mla_export.is_mla(cfg)
    if mla:
        if why := sglang_releases.mla_drafter_refusal(version):
            raise ValueError(f"{export_dir}: an MLA drafter ({mla_export.ARCHITECTURE}): {why}")
        state = mla_export.to_checkpoint(state)  # SGLang takes midlayer.* and layers.0.* alike
    if unread := [
        o for o in options if o not in sglang_releases.release(version).drafter_options("mla" if mla else "gqa")
    ]:
        raise ValueError(
            f"{export_dir}: config.json turns on {', '.join(unread)}, which SGLang {version} does not "
            "read: it would serve this drafter without them"
        )
    unsupported = sorted(k for k in state if k.startswith(_UNSUPPORTED_WEIGHT_PREFIXES))
    if unsupported:
        raise ValueError(
            f"{export_dir}: weights {unsupported} belong to a variant this benchmark's drafter does not implement"
        )
    embed = load_target_tensors(target_dir, want=("embed",)).embed
    assert embed is not None  # asked for: a missing one raised
    embed = embed.float()
    theirs = state.pop("embed_tokens.weight", None)
    if theirs is not None:
        if tuple(theirs.shape) != tuple(embed.shape):
            raise ValueError(
                f"{export_dir}: embed_tokens.weight has shape {tuple(theirs.shape)}, the target's "
                f"embedding {tuple(embed.shape)}"
            )
        diff = float((theirs.float() - embed).abs().max())
        same = "equals the target's" if diff == 0 else f"differs from the target's by up to {diff:.3g}"
        notes.append(
            f"embed_tokens.weight in the export {same}; SGLang serves the draft with the target's "
            "embedding (set_embed) and so does this benchmark"
        )
    want = expected_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in state.items()}
    check.missing = sorted(set(want) - set(got))
    check.unexpected = sorted(set(got) - set(want))
    check.misshaped = {k: (got[k], want[k]) for k in sorted(set(got) & set(want)) if got[k] != want[k]}
    check.non_finite = {
        k: int((~torch.isfinite(v)).sum())
        for k, v in state.items()
        if v.is_floating_point() and not bool(torch.isfinite(v).all())
    }
    check.raise_for_errors()
    dcfg = drafter_config(cfg, aux)
    d2t = state["d2t"].to(torch.int64)
    hot = torch.arange(dcfg.draft_vocab_size) + d2t
    if bool((hot < 0).any() or (hot >= dcfg.vocab_size).any()) or not bool((hot[1:] > hot[:-1]).all()):
        raise ValueError(f"{export_dir}: d2t does not map the draft vocabulary to ascending target ids")
    t2d = torch.zeros(dcfg.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    if not torch.equal(state["t2d"].to(torch.bool), t2d):
        notes.append(
            "t2d disagrees with d2t; SGLang ignores t2d and maps draft ids by d2t, so t2d was rebuilt from d2t"
        )
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    state["t2d"], state["d2t"] = t2d, d2t
    if mla:
        state = mla_export.from_checkpoint(state)
    model = Eagle3Drafter(dcfg, embed, d2t, t2d)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ValueError(
            f"{export_dir}: export does not match the drafter (missing {missing}, unexpected {unexpected})"
        )
    return ImportedDrafter(model.eval(), "external", tuple(aux), origin, notes)


def load_drafter(export_dir: Path, target_dir: Path) -> Eagle3Drafter:
    """Rebuild the drafter from an SGLang-layout export plus the target's embedding.

    This project's exports are read strictly; a standard EAGLE-3 export without the project's
    fields (another trainer's) is read as SGLang serves it. It lives here, not in export.py, so
    that the two modules do not import each other."""
    return load_any_drafter(export_dir, target_dir).model


def load_any_drafter(export_dir: Path, target_dir: Path, *, sglang_version: str | None = None) -> ImportedDrafter:
    """This project's export (strict) or another trainer's (as SGLang serves it), with how it was read.

    Either way the folder is checked as foreign first (`check_drafter_dir`): a config.json carrying this
    project's field is no proof that this project wrote it."""
    check_drafter_dir(export_dir)
    if is_own_export(export_dir):
        canonical = read_drafter_config(Path(export_dir))[OWN_FIELD]
        try:
            _check_aux_layers(canonical, f"{OWN_FIELD}", int(_target_facts(Path(target_dir))[1]["num_hidden_layers"]))
        except ForeignInputError as e:
            raise ForeignInputError(f"{Path(export_dir) / 'config.json'}: {e}") from None
        model = load_own_drafter(export_dir, target_dir)
        return ImportedDrafter(model, "eagle3_dagster", tuple(model.cfg.aux_layers), "eagle3_dagster export config")
    return load_external_drafter(export_dir, target_dir, sglang_version=sglang_version)


def check_drafter_dir(export_dir: Path) -> None:
    """What every reader of a drafter folder may rely on, checked before anything reads it (`eagle3 bench
    --drafter`, the benchmark stage): config.json an object of valid values, every weight file a regular file
    inside the folder. A `ForeignInputError` (or `FileNotFoundError`) naming the file and field otherwise."""
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise FileNotFoundError(f"{export_dir}: not a drafter directory (not a folder)")
    read_drafter_config(export_dir)
    weight_files(export_dir)
