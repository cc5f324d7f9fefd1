"""Kimi's chat format: special-token names, the Jinja chat template, and the completion text.

Owns: the Kimi-K2.5 conversation format as this project renders it for the tiny
target (the real target ships its own template, which the tokenize stage always
prefers), and the two helpers that pin down what the model *generates* after
the generation prompt: `render_completion` and its inverse `parse_completion`.

The template follows Kimi-K2.5's (moonshotai's chat_template.jinja, as tinker-cookbook's
and PrimeIntellect's K2.5 renderers read it):
- each turn is `<|im_{user|assistant|system}|>{name or role}<|im_middle|>{body}<|im_end|>`,
  no BOS, no newline between turns; tool results are system-role turns whose
  name is the message's `name` or `tool`, body `## Return of {tool_call_id}\n{content}`;
- no system turn is added when the conversation has none (K2-Thinking's template
  injects "You are Kimi, ..."; K2.5's does not);
- assistant turns up to the last assistant turn without tool calls are
  "history" and render `<think></think>`; later ones keep `<think>{reasoning_content}</think>`;
- the generation prompt is `<|im_assistant|>assistant<|im_middle|><think>` (K2.5,
  `thinking=True`, the default) or `...<think></think>` with `thinking=False`.
  So `<think>` belongs to the *prompt*: the model generates
  `{reasoning}</think>{content}[tool section]<|im_end|>` (= `render_completion`).
Deviations, on purpose: tools are declared as compact JSON (K2.5's fallback when
no TypeScript declaration is passed), not the TypeScript form; a tool call
without an `id` is rendered `functions.{name}:{index in its message}`; content
given as a list of parts renders only the text parts (no images).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALLS_BEGIN = "<|tool_calls_section_begin|>"
TOOL_CALLS_END = "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN = "<|tool_call_begin|>"
TOOL_CALL_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
TOOL_CALL_END = "<|tool_call_end|>"
BOS = "[BOS]"
EOS = "[EOS]"
PAD = "[PAD]"
UNK = "[UNK]"

# Every one of these is a single token id in the tiny tokenizer (and in Kimi's).
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS,
    EOS,
    IM_END,
    IM_USER,
    IM_ASSISTANT,
    IM_SYSTEM,
    IM_MIDDLE,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_ARGUMENT_BEGIN,
    TOOL_CALL_END,
    THINK_OPEN,
    THINK_CLOSE,
    UNK,
    PAD,
)

# Only `{{ }}` expressions produce text besides the literal markers; every tag trims
# whitespace, so the layout below never leaks into the rendering.
CHAT_TEMPLATE = r"""
{%- macro render_content(msg) -%}
  {%- set c = msg.get('content') -%}
  {%- if c is string -%}{{ c }}
  {%- elif c is not none -%}
    {%- for part in c -%}{%- if part.get('type', 'text') == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- macro render_role(msg) -%}
  {%- set name = msg.get('name') or msg['role'] -%}
  {%- if msg['role'] == 'user' -%}<|im_user|>
  {%- elif msg['role'] == 'assistant' -%}<|im_assistant|>
  {%- else -%}<|im_system|>
  {%- endif -%}{{ name }}<|im_middle|>
{%- endmacro -%}
{%- macro render_tool_calls(msg) -%}
  <|tool_calls_section_begin|>
  {%- for call in msg['tool_calls'] -%}
    <|tool_call_begin|>{{ call.get('id') or ('functions.' ~ call['function']['name'] ~ ':' ~ loop.index0) }}<|tool_call_argument_begin|>
    {%- set args = call['function']['arguments'] -%}
    {%- if args is string -%}{{ args }}{%- else -%}{{ args | tojson }}{%- endif -%}
    <|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}
{%- set ns = namespace(last_plain_assistant=-1) -%}
{%- for i in range(messages | length) -%}
  {%- if messages[i]['role'] == 'assistant' and not messages[i].get('tool_calls') -%}
    {%- set ns.last_plain_assistant = i -%}
  {%- endif -%}
{%- endfor -%}
{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for msg in messages -%}
  {{- render_role(msg) -}}
  {%- if msg['role'] == 'assistant' -%}
    <think>
    {%- if loop.index0 > ns.last_plain_assistant -%}{{ msg.get('reasoning_content') or '' }}{%- endif -%}
    </think>{{- render_content(msg) -}}
    {%- if msg.get('tool_calls') -%}{{- render_tool_calls(msg) -}}{%- endif -%}
  {%- elif msg['role'] == 'tool' -%}
    ## Return of {{ msg.get('tool_call_id') }}{{ '\n' }}{{- render_content(msg) -}}
  {%- else -%}
    {{- render_content(msg) -}}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>
  {%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}
{%- endif -%}
""".strip()


def tool_call_id(call: dict, index: int) -> str:
    """The id the template renders: the call's own id, else Kimi's `functions.{name}:{index}`."""
    return call.get("id") or f"functions.{call['function']['name']}:{index}"


def render_tool_calls(tool_calls: Sequence[dict]) -> str:
    parts = [TOOL_CALLS_BEGIN]
    for i, call in enumerate(tool_calls):
        fn = call.get("function")
        if not isinstance(fn, dict) or "name" not in fn:
            raise ValueError(
                f"tool_calls[{i}]: expected OpenAI shape {{'function': {{'name', 'arguments'}}}}, got {call!r}"
            )
        args = fn.get("arguments", "")
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        parts += [TOOL_CALL_BEGIN, tool_call_id(call, i), TOOL_CALL_ARGUMENT_BEGIN, args, TOOL_CALL_END]
    parts.append(TOOL_CALLS_END)
    return "".join(parts)


def render_completion(
    reasoning: str | None, content: str | None, tool_calls: list[dict] | None = None, *, thinking: bool = True
) -> str:
    """Exactly the text the model generated after the generation prompt (which already holds `<think>`).

    Render the prompt with `add_generation_prompt=True` (same `thinking`) and append this:
    the template itself drops the reasoning of the final plain assistant turn, so rendering
    the whole conversation would not reproduce what was generated.
    """
    if not thinking and reasoning:
        raise ValueError("render_completion: reasoning given but thinking=False (the prompt already closed </think>)")
    text = f"{reasoning or ''}{THINK_CLOSE}" if thinking else ""
    text += content or ""
    if tool_calls:
        text += render_tool_calls(tool_calls)
    return text + IM_END


_CALL = re.compile(
    re.escape(TOOL_CALL_BEGIN)
    + r"\s*(?P<id>[^<]+?)\s*"
    + re.escape(TOOL_CALL_ARGUMENT_BEGIN)
    + r"(?P<args>.*?)"
    + re.escape(TOOL_CALL_END),
    re.DOTALL,
)
_CALL_ID = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)$")


def parse_completion(text: str, *, thinking: bool = True) -> tuple[str | None, str, list[dict] | None]:
    """Split generated text into (reasoning, content, tool_calls) the way SGLang's kimi_k2 parsers do.

    The inverse of `render_completion` for well-formed output; a trailing `<|im_end|>`
    or `[EOS]` is dropped. Reasoning ends at `</think>` or, failing that, at a tool section.
    """
    for stop in (IM_END, EOS):
        if text.endswith(stop):
            text = text[: -len(stop)]
            break
    reasoning = None
    if thinking:
        if text.startswith(THINK_OPEN):
            text = text[len(THINK_OPEN) :]
        end = text.find(THINK_CLOSE)
        if end >= 0:
            reasoning, text = text[:end], text[end + len(THINK_CLOSE) :]
        else:
            cut = text.find(TOOL_CALLS_BEGIN)
            cut = len(text) if cut < 0 else cut
            reasoning, text = text[:cut], text[cut:]
    begin = text.find(TOOL_CALLS_BEGIN)
    if begin < 0:
        return reasoning, text, None
    content, section = text[:begin], text[begin:]
    calls = []
    for m in _CALL.finditer(section):
        id_match = _CALL_ID.match(m["id"])
        name = id_match["name"] if id_match else m["id"]
        calls.append({"id": m["id"], "type": "function", "function": {"name": name, "arguments": m["args"]}})
    return reasoning, content, calls or None


def stop_token_ids(tokenizer) -> list[int]:
    """Ids that end a generated turn: `<|im_end|>` (what chat turns end with) and `[EOS]` where present."""
    ids = []
    for tok in (IM_END, EOS):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if tid is not None and tid != tokenizer.unk_token_id:
            ids.append(tid)
    if not ids:
        raise ValueError(f"tokenizer has neither {IM_END} nor {EOS}: not a Kimi-format tokenizer")
    return ids
