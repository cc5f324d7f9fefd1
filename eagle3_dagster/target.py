"""What a target model directory is, cheaply: its identity, its text config and a summary.

Owns: the target's data version (`target_identity`, its code files included: `target_code`), reading the
text model's config through Kimi-K2.5's multimodal wrapper (the one place `config.json` of a target is
parsed), the summary the `target_model` asset shows, and `TargetFacts`, what every later stage needs about
the profile's target. It never reads weight bytes, so it is as cheap on a 1 TB checkpoint as on the tiny
target.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from eagle3_dagster.io import parse_json
from eagle3_dagster.layers import default_aux_layers, validate_aux_layers
from eagle3_dagster.target_code import check_reviewed, code_files

if TYPE_CHECKING:
    from eagle3_dagster.config import Profile
    from eagle3_dagster.contracts import ArtifactLayout

WEIGHT_INDEX = "model.safetensors.index.json"
# Header length is a little-endian u64; anything larger than this is not a real safetensors file.
_MAX_HEADER_BYTES = 100 << 20


def _read_json(path: Path) -> dict:
    try:
        return parse_json(path.read_bytes(), path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not found (is {path.parent} a model directory?)") from None


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes, offsets), without the data."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {n} is implausible; not a safetensors file")
        try:
            return json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: safetensors header is not valid JSON ({e})") from None


def target_identity(model_dir: Path) -> str:
    """sha256 over config.json bytes, the weight layout (index file, else each file's tensor names/dtypes/shapes)
    and the folder's code files (`target_code.code_files`: what `--trust-remote-code` runs), when it has any.

    A re-quantised or re-sharded checkpoint changes the identity, and so does an edited or added Python file;
    copying the folder elsewhere does not. Retrained weights of the same layout do not, unless config.json
    says so: the tiny build writes `weights_sha256` into it for that reason. A folder without code files has
    the identity it had before code files counted.
    """
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    config = model_dir / "config.json"
    if not config.exists():
        raise FileNotFoundError(f"{config}: not found (is {model_dir} a model directory?)")
    h.update(b"config.json\0" + config.read_bytes())
    index = model_dir / WEIGHT_INDEX
    if index.exists():
        h.update(b"\0" + WEIGHT_INDEX.encode() + b"\0" + index.read_bytes())
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no {WEIGHT_INDEX} and no *.safetensors files")
        for f in files:
            header = safetensors_header(f)
            layout = {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}
            h.update(b"\0" + f.name.encode() + b"\0" + orjson.dumps(layout, option=orjson.OPT_SORT_KEYS))
    for name, digest in code_files(model_dir).items():  # sorted by name
        h.update(b"\0code\0" + name.encode() + b"\0" + digest.encode())
    return h.hexdigest()


# The files a tokenizer is made of (HF fast and slow, sentencepiece, tiktoken, remote code, chat templates).
_TOKENIZER_FILES = (
    "tokeniz*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "tiktoken.model",
    "chat_template*",
)


def tokenizer_identity(model_dir: Path) -> str:
    """sha256 over the tokenizer's files (names and bytes): a tokenizer whose ids are permuted, or whose
    chat template changed, is another tokenizer even when the vocabulary size and the weights are the same.
    `target_identity` leaves these files out, so answers record both."""
    model_dir = Path(model_dir)
    files = sorted({f for pattern in _TOKENIZER_FILES for f in model_dir.glob(pattern) if f.is_file()})
    if not files:
        raise FileNotFoundError(f"{model_dir}: no tokenizer files (tokenizer.json, tokenizer_config.json, ...)")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def answer_producer(backend: str, model_dir: Path, *, served_model: str | None = None) -> dict:
    """Who produced a regenerated answer, as every stored turn records it: the target itself (its identity)
    for the in-process backend, the served model's name for an API; and the tokenizer its tokens are read
    with. An answer recorded under another producer is neither reused nor tokenized."""
    producer: dict[str, str | None] = {"backend": backend, "tokenizer": tokenizer_identity(model_dir)}
    if backend == "local":
        producer["target"] = target_identity(model_dir)
    else:
        producer["model"] = served_model
    return producer


def load_target_config(model_dir: Path) -> dict:
    """The text model's config: Kimi-K2.5's `text_config` when wrapped, else config.json itself.

    Wrapper fields the text config lacks (e.g. `quantization_config`, `torch_dtype`) are carried over.
    """
    raw = _read_json(Path(model_dir) / "config.json")
    text = raw.get("text_config")
    if not isinstance(text, dict):
        return raw
    merged = dict(text)
    for key in ("quantization_config", "torch_dtype", "dtype", "tie_word_embeddings"):
        if key in raw and key not in merged:
            merged[key] = raw[key]
    merged.setdefault("architectures", ["DeepseekV3ForCausalLM"])
    return merged


def target_summary(model_dir: Path) -> dict:
    """The figures a reader checks first: layers, hidden size, vocab, architecture, dtype."""
    raw = _read_json(Path(model_dir) / "config.json")
    cfg = load_target_config(model_dir)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"{Path(model_dir) / 'config.json'}: text config lacks {missing}")
    return {
        "num_layers": int(cfg["num_hidden_layers"]),
        "hidden_size": int(cfg["hidden_size"]),
        "vocab_size": int(cfg["vocab_size"]),
        "architecture": (raw.get("architectures") or cfg.get("architectures") or ["unknown"])[0],
        "text_architecture": (cfg.get("architectures") or ["unknown"])[0],
        "dtype": str(
            cfg.get("torch_dtype") or cfg.get("dtype") or raw.get("torch_dtype") or raw.get("dtype") or "unknown"
        ),
        "quantization": (cfg.get("quantization_config") or {}).get("quant_method"),
    }


def load_tokenizer(model_dir: str | Path, *, trust_remote_code: bool, reviewed_code: Mapping[str, str] | None = None):
    """The target's tokenizer, from the model directory alone. Code shipped with a checkpoint runs only when the
    profile's `target.trust_remote_code` says so; a model that needs it gets an error naming that switch.
    With `reviewed_code` (the profile's `target.reviewed_code`), code that is not the reviewed code is refused
    before any of it runs (`target_code.check_reviewed`).
    Nothing is fetched (`local_files_only`): a tokenizer config whose `auto_map` names a hub repository
    (`org/repo--module.Class`) would otherwise download and run that repository's code."""
    from transformers import AutoTokenizer

    if trust_remote_code:
        check_reviewed(model_dir, reviewed_code)
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True)
    except ImportError as e:  # shipped code importing a package this interpreter lacks (Kimi-K2.5: tiktoken)
        missing = getattr(e, "name", None) or str(e).split("environment: ", 1)[-1].split(". Run", 1)[0]
        raise ValueError(
            f"{model_dir}: this model's tokenizer needs the Python package {missing}, which is not installed in "
            f"{__import__('sys').executable}; pip install {missing} (tiktoken comes with this project's "
            f"[pipeline] extra): {e}"
        ) from e
    except ValueError as e:
        if trust_remote_code or "trust_remote_code" not in str(e):
            raise
        raise ValueError(
            f"{model_dir}: this model's tokenizer is Python code shipped with the checkpoint, which runs only when "
            f"the profile sets target.trust_remote_code: true (read that code first: it runs with your rights)"
        ) from None
    except OSError:
        if not (foreign := _hub_code_references(Path(model_dir))):
            raise
        raise ValueError(
            f"{model_dir}: {foreign[0]} names code in a hub repository, which is never fetched (only the model "
            f"directory's own files are loaded): copy that code into the directory and name it without the "
            f"'repository--' prefix"
        ) from None


def _hub_code_references(model_dir: Path) -> list[str]:
    """The `auto_map` entries of a model directory's configs that name another repository's code
    (transformers' `org/repo--module.Class`), as 'file auto_map.Key: org/repo'."""
    found = []
    for name in ("tokenizer_config.json", "config.json"):
        try:
            auto_map = json.loads((model_dir / name).read_text()).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        for key, refs in auto_map.items() if isinstance(auto_map, dict) else ():
            for ref in refs if isinstance(refs, list) else [refs]:
                if isinstance(ref, str) and "--" in ref:
                    found.append(f"{name} auto_map.{key}: {ref.split('--', 1)[0]}")
    return found


@dataclass(frozen=True)
class TargetFacts:
    path: Path
    identity: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layers: tuple[int, ...]  # canonical numbering


def target_dir(profile: "Profile", layout: "ArtifactLayout") -> Path:
    if profile.target.kind == "tiny":
        return layout.target_dir
    if profile.target.path is None:  # the schema requires it of an external target
        raise ValueError("target.path: an external target needs its path")
    return Path(profile.target.path)


def target_facts(profile: "Profile", layout: "ArtifactLayout") -> TargetFacts:
    """What every later stage needs about the profile's target (`target_facts_at`)."""
    return target_facts_at(target_dir(profile, layout), profile.hidden.aux_layers)


def target_facts_at(path: Path, aux_layers: Sequence[int] | None) -> TargetFacts:
    """What every later stage needs about the target in `path`: where, which (identity), its sizes and the
    canonical aux layers (`aux_layers`, hidden.aux_layers, else EAGLE-3's default for its depth)."""
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"target_model: {path}/config.json not found; materialize target_model first")
    summary = target_summary(path)
    layers = aux_layers or default_aux_layers(summary["num_layers"])
    return TargetFacts(
        path=path,
        identity=target_identity(path),
        num_layers=summary["num_layers"],
        hidden_size=summary["hidden_size"],
        vocab_size=summary["vocab_size"],
        aux_layers=tuple(validate_aux_layers(list(layers), summary["num_layers"])),
    )
