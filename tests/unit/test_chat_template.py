"""Kimi chat format: exact renderings, the generated-completion text, and the tokenizer round trip."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from eagle3_dagster.chat import kimi
from eagle3_dagster.chat.kimi import parse_completion, render_completion, stop_token_ids

SYS = ""  # Kimi-K2.5's template adds no system turn when the conversation has none (K2-Thinking's did)
CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
CALL_TEXT = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


@pytest.fixture(scope="module")
def tok(micro_target):
    return AutoTokenizer.from_pretrained(str(micro_target))


def render(tok, messages, **kw) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def test_system_and_user_with_generation_prompt_opens_think(tok):
    got = render(
        tok, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    assert got == (
        "<|im_system|>system<|im_middle|>Be terse.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )


def test_missing_system_message_adds_no_system_turn_and_thinking_off_closes_think(tok):
    got = render(tok, [{"role": "user", "content": "Hi"}], add_generation_prompt=True, thinking=False)
    assert got == SYS + "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|><think></think>"


def test_multi_turn_drops_reasoning_up_to_last_plain_assistant_turn(tok):
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "r1"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d", "reasoning_content": "r2"},
    ]
    assert render(tok, messages) == (
        SYS
        + "<|im_user|>user<|im_middle|>a<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|><think></think>b<|im_end|>"
        + "<|im_user|>user<|im_middle|>c<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|><think></think>d<|im_end|>"
    )


def test_tool_call_turn_after_last_plain_answer_keeps_reasoning_and_tool_result_is_a_system_turn(tok):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "old"},
        {"role": "assistant", "content": "old answer", "reasoning_content": "dropped"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "need tool", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"temp": 21}'},
    ]
    assert render(tok, messages, add_generation_prompt=True) == (
        "<|im_system|>system<|im_middle|>S<|im_end|>"
        "<|im_user|>user<|im_middle|>old<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>old answer<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>need tool</think>Let me check." + CALL_TEXT + "<|im_end|>"
        '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{"temp": 21}<|im_end|>'
        "<|im_assistant|>assistant<|im_middle|><think>"
    )


def test_tools_are_declared_first_as_compact_json_and_missing_ids_become_functions_name_index(tok):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": None, "tool_calls": [call, call]}]
    assert render(tok, messages, tools=tools) == (
        '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]<|im_end|>'
        + SYS
        + "<|im_user|>user<|im_middle|>u<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|>"
        + '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|>'
        + '<|tool_call_begin|>functions.f:1<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|>'
        + "<|tool_calls_section_end|><|im_end|>"
    )


def test_render_completion_is_exactly_what_follows_the_generation_prompt():
    assert render_completion("think hard", "Answer.", None) == "think hard</think>Answer.<|im_end|>"
    assert render_completion(None, "Answer.") == "</think>Answer.<|im_end|>"
    assert render_completion(None, "Answer.", thinking=False) == "Answer.<|im_end|>"
    assert render_completion("r", "Let me check.", [CALL]) == "r</think>Let me check." + CALL_TEXT + "<|im_end|>"
    with pytest.raises(ValueError, match="thinking=False"):
        render_completion("r", "x", thinking=False)


def test_prompt_plus_completion_tokenizes_like_the_full_rendering_of_a_kept_reasoning_turn(tok):
    prompt = [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather in Paris?"}]
    turn = {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "I should call the tool.",
        "tool_calls": [CALL],
    }
    prompt_ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)["input_ids"]
    completion_ids = tok.encode(
        render_completion(turn["reasoning_content"], turn["content"], turn["tool_calls"]), add_special_tokens=False
    )
    full_ids = tok.apply_chat_template(prompt + [turn], tokenize=True)["input_ids"]
    assert prompt_ids + completion_ids == full_ids


def test_parse_completion_inverts_render_completion():
    for reasoning, content, calls in [("r", "c", None), ("", "just text", None), ("plan", "", [CALL])]:
        text = render_completion(reasoning, content, calls)
        assert parse_completion(text) == (reasoning, content, calls)
    assert parse_completion("no end of think" + CALL_TEXT)[0] == "no end of think"
    assert parse_completion("plain<|im_end|>", thinking=False) == (None, "plain", None)


def test_every_special_token_is_one_id_and_text_round_trips(tok):
    ids = {t: tok.encode(t, add_special_tokens=False) for t in kimi.SPECIAL_TOKENS}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert len({v[0] for v in ids.values()}) == len(kimi.SPECIAL_TOKENS)
    text = render(
        tok,
        [
            {"role": "user", "content": "Héllo wörld 你好 — tabs\tand\nnewlines  "},
            {"role": "assistant", "content": "ok", "tool_calls": [CALL]},
        ],
        add_generation_prompt=True,
    )
    encoded = tok.encode(text, add_special_tokens=False)
    assert tok.decode(encoded) == text
    assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi", add_special_tokens=False)  # no BOS, like Kimi


def test_stop_token_ids_are_im_end_then_eos(tok):
    assert stop_token_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("[EOS]")]
