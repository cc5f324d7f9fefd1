"""The target running in-process with transformers, behind the same `ChatBackend` interface.

Owns: the demo's "server": render the prompt with the target's own chat template
(generation prompt included), generate greedily or with temperature until
`<|im_end|>`, and parse the generated text back into reasoning / content /
tool_calls with the Kimi parser, so records look exactly like an API's. Usage
counts are the real prompt and generated token counts; cost is zero.

One model, one forward at a time: calls are serialised with a lock and run in a
worker thread so the event loop (and progress reporting) stays responsive.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3_dagster.chat.kimi import parse_completion, stop_token_ids
from eagle3_dagster.generate.client import ChatRequestError, ChatResult


class LocalChatBackend:
    """Generation with `model.generate`; `paid=False`, so an interrupted request is simply re-run."""

    paid = False

    def __init__(self, model_dir: str | Path, device: str = "cpu", *, dtype: str = "float32", seed: int = 0) -> None:
        self.model_dir = Path(model_dir)
        self.device = device
        self.seed = seed
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if not self.tokenizer.chat_template:
            raise ValueError(f"{self.model_dir}: tokenizer has no chat template")
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        self._stop_ids = stop_token_ids(self.tokenizer)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LocalChatBackend(model_dir={str(self.model_dir)!r}, device={self.device!r})"

    def generate(self, messages: list[dict], *, request_id: str, max_tokens: int, temperature: float,
                 reasoning: bool) -> ChatResult:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                    thinking=reasoning)
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        input_ids = torch.tensor([prompt_ids], device=self.device)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        with self._lock, torch.inference_mode():
            # Seeded per request, so a re-run of the same request id samples the same answer.
            torch.manual_seed(self.seed ^ int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16))
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                eos_token_id=self._stop_ids, pad_token_id=self._stop_ids[0], top_k=None, top_p=None, **sampling,
            )
        generated = out[0, len(prompt_ids):].tolist()
        finished = bool(generated) and generated[-1] in self._stop_ids
        text = self.tokenizer.decode(generated, skip_special_tokens=False)
        reasoning_text, content, tool_calls = parse_completion(text, thinking=reasoning)
        return ChatResult(
            reasoning=reasoning_text or "", content=content, tool_calls=tool_calls or [],
            finish_reason="stop" if finished else "length",
            usage={"prompt_tokens": len(prompt_ids), "completion_tokens": len(generated),
                   "total_tokens": len(prompt_ids) + len(generated)},
            cost=0.0, provider="local", model=str(self.model_dir.name),
        )

    async def complete(self, messages: list[dict], *, request_id: str, max_tokens: int,
                       temperature: float, reasoning: bool) -> ChatResult:
        try:
            return await asyncio.to_thread(self.generate, messages, request_id=request_id, max_tokens=max_tokens,
                                           temperature=temperature, reasoning=reasoning)
        except (ValueError, RuntimeError) as e:
            raise ChatRequestError("local_error", f"{type(e).__name__}: {e}") from e

    async def aclose(self) -> None:
        return None
