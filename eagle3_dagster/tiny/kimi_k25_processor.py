"""The processor a tiny Kimi-K2.5 checkpoint ships as remote code (copied in by `tiny.kimi_k25`).

Ours, written for the tiny checkpoint; nothing of Kimi's processor is in it. SGLang builds a
multimodal processor for every `KimiK25ForConditionalGeneration` server, text-only or not
(`managers/tokenizer_manager.py`, `init_tokenizer_and_processor`, through `AutoProcessor` with
`--trust-remote-code`), and its Kimi processor reads three things off the HF one
(`multimodal/processors/kimi_k25.py`, `KimiK2_5VLImageProcessor.__init__` and
`KimiGPUProcessorWrapper.__init__`): `tokenizer`, `image_processor` and
`media_processor.media_proc_cfg` (patch size, merge kernel, patch limits, normalisation).
This class provides exactly those. It preprocesses no media: the tiny checkpoint's vocabulary has
no `<|media_pad|>`, so it serves text only, and a request with an image is refused by name.

Self-contained (transformers only): it runs from the checkpoint folder in SGLang's interpreter.
"""

from __future__ import annotations

import json
import os

from transformers import AutoTokenizer


class KimiK25MediaProcessor:
    """Holds the checkpoint's `media_proc_cfg` (preprocessor_config.json); preprocesses nothing."""

    def __init__(self, media_proc_cfg: dict):
        self.media_proc_cfg = dict(media_proc_cfg)

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("tiny Kimi-K2.5 checkpoint: text only, it has no media preprocessing")

    preprocess = __call__


class KimiK25Processor:
    def __init__(self, tokenizer, media_processor: KimiK25MediaProcessor):
        self.tokenizer = tokenizer
        self.media_processor = media_processor
        self.image_processor = media_processor

    @classmethod
    def register_for_auto_class(cls, auto_class: str = "AutoProcessor") -> None:
        """transformers' AutoProcessor calls this on remote-code classes; nothing to register."""

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        kwargs.pop("_from_auto", None)
        kwargs.pop("use_fast", None)
        tokenizer = AutoTokenizer.from_pretrained(path, *args, **kwargs)
        with open(os.path.join(path, "preprocessor_config.json")) as f:
            media_proc_cfg = json.load(f)["media_proc_cfg"]
        return cls(tokenizer, KimiK25MediaProcessor(media_proc_cfg))

    def __call__(self, text=None, images=None, videos=None, **kwargs):
        if images or videos:
            raise NotImplementedError("tiny Kimi-K2.5 checkpoint: text only, it has no media preprocessing")
        return self.tokenizer(text, **kwargs)
