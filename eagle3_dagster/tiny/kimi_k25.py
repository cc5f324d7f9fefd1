"""The tiny target in Kimi-K2.5's checkpoint layout: the same text model inside `KimiK25ForConditionalGeneration`.

Owns: turning a built tiny target (a `DeepseekV3ForCausalLM` folder, `tiny.build`) into the folder
layout of the released Kimi-K2.5 checkpoint, so that SGLang serves the text model through the
class production runs, whose forward calls the language model with `input_ids=None` and the
embeddings (`managers/mm_utils.py`, `general_mm_embed_routine`):

- `config.json`: `architectures: ["KimiK25ForConditionalGeneration"]`, `model_type: "kimi_k25"`,
  the text model's config under `text_config`, a tiny `vision_config`, `media_placeholder_token_id`,
  and `auto_map.AutoProcessor` naming the processor below;
- `model.safetensors`: the text weights as `language_model.` + their transformers names (Kimi's
  names; SGLang strips the prefix and hands the rest to DeepSeek-V3's loader), and a random MoonViT
  tower and projector under Kimi's names (`vision_tower.encoder.blocks.N.wqkv`, `.wo`,
  `mm_projector.proj.0`, `.proj.2`, ...), which SGLang maps onto its modules;
- the tokenizer files, chat template and generation config, unchanged;
- `preprocessor_config.json` (`media_proc_cfg`) and `kimi_k25_processor.py`: our minimal processor
  (`tiny.kimi_k25_processor`), because SGLang builds Kimi's multimodal processor at start-up even
  for text; serving it needs `--trust-remote-code`, as the production checkpoint does.

The text model is the tiny target's, weight for weight, so transformers' `output_hidden_states` of
the tiny target is the reference for what SGLang computes from this folder. The tiny vocabulary has
no `<|media_pad|>`: the placeholder id is one past the vocabulary, so no text token is ever taken for
an image, and the folder serves text only.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3_dagster.io import atomic_write_json

PROCESSOR_FILE = "kimi_k25_processor.py"
TEXT_PREFIX = "language_model."
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)


@dataclass(frozen=True)
class TinyVision:
    """MoonViT sizes. Head dim (hidden / heads) must be a multiple of 4 (SGLang's 2-D RoPE)."""

    hidden_size: int = 16
    num_attention_heads: int = 2
    num_hidden_layers: int = 1
    intermediate_size: int = 32
    patch_size: int = 14
    init_pos_emb_height: int = 4
    init_pos_emb_width: int = 4
    init_pos_emb_time: int = 4
    merge_kernel_size: tuple[int, int] = (2, 2)


def kimi_k25_config(text_config: dict, vision: TinyVision) -> dict:
    """Kimi-K2.5's config.json around `text_config`.

    The vision sizes are written twice: Kimi's checkpoint names them `vt_*` (read by SGLang's
    projector), while SGLang's `KimiK25VisionConfig` builds the tower from the plain names, whose
    defaults are Kimi's real sizes (1152, 16 heads, 27 layers, 4304).
    """
    text = {k: v for k, v in text_config.items() if k not in ("transformers_version",)}
    merge = list(vision.merge_kernel_size)
    vision_config = {
        "patch_size": vision.patch_size,
        "init_pos_emb_height": vision.init_pos_emb_height,
        "init_pos_emb_width": vision.init_pos_emb_width,
        "init_pos_emb_time": vision.init_pos_emb_time,
        "pos_emb_type": "divided_fixed",
        "merge_kernel_size": merge,
        "merge_type": "sd2_tpool",
        "video_attn_type": "spatial_temporal",
        "vt_hidden_size": vision.hidden_size,
        "vt_num_attention_heads": vision.num_attention_heads,
        "vt_num_hidden_layers": vision.num_hidden_layers,
        "vt_intermediate_size": vision.intermediate_size,
        "hidden_size": vision.hidden_size,
        "num_attention_heads": vision.num_attention_heads,
        "num_hidden_layers": vision.num_hidden_layers,
        "intermediate_size": vision.intermediate_size,
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": vision.hidden_size,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "text_hidden_size": text["hidden_size"],
    }
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": {"AutoProcessor": f"{PROCESSOR_FILE[:-3]}.KimiK25Processor"},
        "text_config": text,
        "vision_config": vision_config,
        "media_placeholder_token_id": text["vocab_size"],
        "pad_token_id": text.get("pad_token_id", 0),
        "bos_token_id": text.get("bos_token_id"),
        "eos_token_id": text.get("eos_token_id"),
        "tie_word_embeddings": False,
        "torch_dtype": text.get("torch_dtype") or text.get("dtype") or "float32",
    }


def vision_weights(vision: TinyVision, text_hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """A random MoonViT tower and patch-merger projector, under Kimi's checkpoint names."""
    g = torch.Generator().manual_seed(seed)
    h, mlp = vision.hidden_size, vision.intermediate_size
    merged = h * vision.merge_kernel_size[0] * vision.merge_kernel_size[1]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    def norm(prefix: str, n: int) -> dict[str, torch.Tensor]:
        return {f"{prefix}.weight": torch.ones(n), f"{prefix}.bias": torch.zeros(n)}

    out = {
        "vision_tower.patch_embed.proj.weight": rand(h, 3, vision.patch_size, vision.patch_size),
        "vision_tower.patch_embed.proj.bias": torch.zeros(h),
        "vision_tower.patch_embed.pos_emb.weight": rand(vision.init_pos_emb_height, vision.init_pos_emb_width, h),
        **norm("vision_tower.encoder.final_layernorm", h),
        **norm("mm_projector.pre_norm", h),
        "mm_projector.proj.0.weight": rand(merged, merged),
        "mm_projector.proj.0.bias": torch.zeros(merged),
        "mm_projector.proj.2.weight": rand(text_hidden, merged),
        "mm_projector.proj.2.bias": torch.zeros(text_hidden),
    }
    for i in range(vision.num_hidden_layers):
        b = f"vision_tower.encoder.blocks.{i}"
        out |= {
            **norm(f"{b}.norm0", h),
            **norm(f"{b}.norm1", h),
            f"{b}.wqkv.weight": rand(3 * h, h),
            f"{b}.wqkv.bias": torch.zeros(3 * h),
            f"{b}.wo.weight": rand(h, h),
            f"{b}.wo.bias": torch.zeros(h),
            f"{b}.mlp.fc0.weight": rand(mlp, h),
            f"{b}.mlp.fc0.bias": torch.zeros(mlp),
            f"{b}.mlp.fc1.weight": rand(h, mlp),
            f"{b}.mlp.fc1.bias": torch.zeros(h),
        }
    return out


def wrap_as_kimi_k25(text_dir: Path, out_dir: Path, *, vision: TinyVision = TinyVision(), seed: int = 0) -> Path:
    """Write `out_dir`: the tiny target of `text_dir` in Kimi-K2.5's checkpoint layout (module docstring)."""
    text_dir, out_dir = Path(text_dir), Path(out_dir)
    text_config = json.loads((text_dir / "config.json").read_text())
    if "text_config" in text_config:
        raise ValueError(f"{text_dir}: already a wrapped checkpoint (its config.json has text_config)")
    text = load_file(str(text_dir / "model.safetensors"))
    dtypes = {t.dtype for t in text.values()}
    if len(dtypes) != 1:
        raise ValueError(f"{text_dir}: weights of several dtypes {sorted(map(str, dtypes))}")
    (dtype,) = dtypes
    weights = {TEXT_PREFIX + name: t for name, t in text.items()}
    weights |= {k: v.to(dtype) for k, v in vision_weights(vision, text_config["hidden_size"], seed).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    atomic_write_json(out_dir / "config.json", kimi_k25_config(text_config, vision))
    media_proc_cfg = {
        "patch_size": vision.patch_size,
        "merge_kernel_size": vision.merge_kernel_size[0],
        "in_patch_limit": vision.init_pos_emb_height * vision.init_pos_emb_width,
        "patch_limit_on_one_side": vision.init_pos_emb_height,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    atomic_write_json(
        out_dir / "preprocessor_config.json", {"media_proc_cfg": media_proc_cfg, "tiny_vision": asdict(vision)}
    )
    shutil.copyfile(Path(__file__).with_name(PROCESSOR_FILE), out_dir / PROCESSOR_FILE)
    for name in COPIED_FILES:
        if (text_dir / name).exists():
            shutil.copyfile(text_dir / name, out_dir / name)
    return out_dir
