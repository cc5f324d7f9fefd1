"""The target running in-process with transformers, behind the same `ChatBackend` interface.

Owns: the demo's "server": render the prompt with the target's own chat template
(generation prompt included), generate greedily or with temperature until
`<|im_end|>`, and parse the generated text back into reasoning / content /
tool_calls with the Kimi parser, so records look exactly like an API's. Usage
counts are the real prompt and generated token counts; cost is zero.

Micro-batching: on CPU a tiny target's decode step is almost all per-call Python
overhead, so one `generate` for 32 prompts costs little more than one for a
single prompt. `complete()` therefore only queues its request; one worker thread
(the only one that touches the model) gathers whatever is pending, waiting
`batch_wait_s` after each arrival for more, up to `max_batch`, and runs one
left-padded `generate` per (max_tokens, temperature) group. The event loop stays
free while it runs. Greedy answers do not depend on the batch, and neither do
sampled ones: each row draws from its own random stream, seeded by its request id
(`RowSampler`), so an answer repeats whichever requests share its batch (batch
composition depends on timing, and a seed per batch made two demo runs train on
different corpora).
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from eagle3_dagster.chat.kimi import parse_completion, stop_token_ids
from eagle3_dagster.generate.client import ChatRequestError, ChatResult

_STOP = object()  # queue sentinel: the worker exits


@dataclass
class _Request:
    messages: list[dict]
    request_id: str
    max_tokens: int
    temperature: float
    reasoning: bool
    future: Future = field(default_factory=Future)
    prompt_ids: list[int] = field(default_factory=list)


def _batch_key(r: _Request) -> tuple[int, float]:
    """Requests generate together when they ask for the same length and temperature."""
    return r.max_tokens, r.temperature


def _local_error(e: BaseException) -> BaseException:
    """Model and template failures become a failed request; anything else is a bug and propagates as is."""
    if isinstance(e, (ValueError, RuntimeError)):
        return ChatRequestError("local_error", f"{type(e).__name__}: {e}")
    return e


class LocalChatBackend:
    """Generation with batched `model.generate`; `paid=False`, so an interrupted request is simply re-run."""

    paid = False

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_batch: int = 32,
        batch_wait_s: float = 0.005,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model_dir = Path(model_dir)
        self.device = device
        self.seed = seed
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        # the target's directory alone: nothing is fetched (an auto_map naming a hub repository would be)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        if not self.tokenizer.chat_template:
            raise ValueError(f"{self.model_dir}: tokenizer has no chat template")
        if self.tokenizer.pad_token_id is None:
            raise ValueError(f"{self.model_dir}: tokenizer has no pad token, needed to batch prompts")
        self.tokenizer.padding_side = "left"  # generation continues from the last column
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, dtype), local_files_only=True)
        # transformers types PreTrainedModel.to through a decorator that takes the model as its argument
        self.model = model.to(device).eval()  # type: ignore[arg-type]
        self._stop_ids = stop_token_ids(self.tokenizer)
        self._queue: queue.Queue = queue.Queue()  # one per worker, so a closing worker's sentinel is its own
        self._worker: threading.Thread | None = None
        self._worker_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LocalChatBackend(model_dir={str(self.model_dir)!r}, device={self.device!r})"

    async def complete(
        self,
        messages: list[dict],
        *,
        request_id: str,
        max_tokens: int,
        temperature: float,
        reasoning: bool,
        before_resend=None,
    ) -> ChatResult:
        request = _Request(list(messages), request_id, max_tokens, temperature, reasoning)
        with self._worker_lock:  # started lazily, so the backend also works again after `aclose`
            if self._worker is None:
                self._queue = queue.Queue()
                self._worker = threading.Thread(
                    target=self._serve, args=(self._queue,), name="local-generate", daemon=True
                )
                self._worker.start()
            self._queue.put(request)
        return await asyncio.wrap_future(request.future)

    async def aclose(self) -> None:
        with self._worker_lock:
            worker, self._worker = self._worker, None
            if worker is None:
                return
            self._queue.put(_STOP)  # after every request already queued: those are still answered
        await asyncio.to_thread(worker.join)

    def _serve(self, requests: queue.Queue) -> None:
        stopping = False
        while not stopping:
            first = requests.get()
            if first is _STOP:
                return
            pending = [first]
            while len(pending) < self.max_batch:
                try:
                    item = requests.get(timeout=self.batch_wait_s)
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                pending.append(item)
            # Cancelled awaits are dropped here; the rest can no longer be cancelled.
            live = [r for r in pending if r.future.set_running_or_notify_cancel()]
            for _, group in groupby(sorted(live, key=_batch_key), key=_batch_key):
                self._run_batch(list(group))

    def _run_batch(self, batch: list[_Request]) -> None:
        ready = []
        for r in batch:  # a prompt the template cannot render fails alone, not its batch
            try:
                prompt = self.tokenizer.apply_chat_template(
                    r.messages, add_generation_prompt=True, tokenize=False, thinking=r.reasoning
                )
                r.prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
                ready.append(r)
            except Exception as e:  # bad history (e.g. a malformed tool call) fails its request
                r.future.set_exception(
                    ChatRequestError(
                        "local_error", f"request {r.request_id}: chat template failed: {type(e).__name__}: {e}"
                    )
                )
        if not ready:
            return
        try:
            rows = self._generate(ready)
        except Exception as e:  # every request of the batch fails; the worker carries on
            for r in ready:
                r.future.set_exception(_local_error(e))
            return
        for r, generated in zip(ready, rows):
            try:
                r.future.set_result(self._result(r, generated))
            except Exception as e:
                r.future.set_exception(_local_error(e))

    def _generate(self, batch: list[_Request]) -> list[list[int]]:
        """One `generate` for the batch; each row cut after its first stop token (pad columns follow it)."""
        padded = self.tokenizer.pad({"input_ids": [r.prompt_ids for r in batch]}, padding=True, return_tensors="pt")
        input_ids = padded["input_ids"].to(self.device)
        temperature, max_tokens = batch[0].temperature, batch[0].max_tokens
        # generate() samples a whole batch from one global generator; sampling is done here instead, row by
        # row, and generate() only takes the argmax of what the sampler returns.
        processors = LogitsProcessorList(
            [RowSampler([self.seed ^ _ids_hash([r.request_id]) for r in batch], temperature)] if temperature > 0 else []
        )
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=padded["attention_mask"].to(self.device),
                max_new_tokens=max_tokens,
                eos_token_id=self._stop_ids,
                pad_token_id=self.tokenizer.pad_token_id,
                top_k=None,
                top_p=None,
                temperature=None,
                do_sample=False,
                logits_processor=processors,
            )
        rows = []
        for row in out[:, input_ids.shape[1] :].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in self._stop_ids), len(row))
            rows.append(row[:end])
        return rows

    def _result(self, r: _Request, generated: list[int]) -> ChatResult:
        finished = bool(generated) and generated[-1] in self._stop_ids
        text = str(self.tokenizer.decode(generated, skip_special_tokens=False))  # one sequence: one string
        reasoning_text, content, tool_calls = parse_completion(text, thinking=r.reasoning)
        return ChatResult(
            reasoning=reasoning_text or "",
            content=content,
            tool_calls=tool_calls or [],
            finish_reason="stop" if finished else "length",
            usage={
                "prompt_tokens": len(r.prompt_ids),
                "completion_tokens": len(generated),
                "total_tokens": len(r.prompt_ids) + len(generated),
            },
            cost=0.0,
            provider="local",
            model=str(self.model_dir.name),
            completion_ids=[int(t) for t in generated],
        )


class RowSampler(LogitsProcessor):
    """Sampling at `temperature` with one random stream per row: Gumbel-max, argmax(logits / T + G) with
    G = -log(Exp(1)) noise is a draw from softmax(logits / T), so greedy decoding of the returned scores
    samples each row from its own seeded generator, whatever else is in the batch."""

    def __init__(self, seeds: list[int], temperature: float) -> None:
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.temperature = temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        gumbel = torch.stack([-torch.empty(vocab).exponential_(generator=g).log_() for g in self.generators])
        return scores.float() / self.temperature + gumbel.to(scores.device)


def _ids_hash(request_ids) -> int:
    return int(hashlib.sha256("\n".join(sorted(request_ids)).encode()).hexdigest()[:8], 16)
