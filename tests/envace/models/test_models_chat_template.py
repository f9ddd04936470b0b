"""The envace Qwen3 chat template renders exactly like Qwen3's official one (expected strings written out)."""

from __future__ import annotations

import pytest

from envace.models import render_chat

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time.",
        "parameters": {"type": "object", "properties": {}},
    },
}

TOOLS_SYSTEM = (
    "<|im_start|>system\n"
    "You are a helpful assistant.\n\n"
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}, '
    '"required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "get_time", "description": "Current time.", '
    '"parameters": {"type": "object", "properties": {}}}}\n'
    "</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)

PLAIN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello! How can I help?"},
    {"role": "user", "content": "Tell me a joke."},
]
PLAIN_EXPECTED = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nHi!<|im_end|>\n"
    # reasoning of a turn before the last user query is dropped, as Qwen3 does
    "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
    "<|im_start|>user\nTell me a joke.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

TOOL_TURN = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "I should call get_weather.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 18, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 18 °C and clear in Paris."},
]
TOOL_TURN_EXPECTED = (
    TOOLS_SYSTEM + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    # after the last user query reasoning is kept
    "<|im_start|>assistant\n<think>\nI should call get_weather.\n</think>\n\nLet me check.\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n"
    '{"temp": 18, "sky": "clear"}\n'
    "</tool_response><|im_end|>\n"
    # the final assistant message always gets a (here empty) think block
    "<|im_start|>assistant\n<think>\n\n</think>\n\nIt is 18 °C and clear in Paris.<|im_end|>\n"
)

MULTI = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Paris and Tōkyō, and the time?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tōkyō"}'}},
            {"name": "get_time", "arguments": {}},
        ],
    },
    {"role": "tool", "content": '{"temp": 18}'},
    {"role": "tool", "content": '{"temp": 25}'},
    {"role": "tool", "content": "12:00"},
]
MULTI_EXPECTED = (
    TOOLS_SYSTEM + "<|im_start|>user\nWeather in Paris and Tōkyō, and the time?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n"
    '<tool_response>\n{"temp": 18}\n</tool_response>\n'
    '<tool_response>\n{"temp": 25}\n</tool_response>\n'
    "<tool_response>\n12:00\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_plain_chat():
    assert render_chat(PLAIN, add_generation_prompt=True) == PLAIN_EXPECTED


def test_no_system_no_generation_prompt():
    assert render_chat([{"role": "user", "content": "Hi"}]) == "<|im_start|>user\nHi<|im_end|>\n"


def test_tools_tool_call_and_response():
    assert render_chat(TOOL_TURN, [WEATHER, TIME]) == TOOL_TURN_EXPECTED


def test_multiple_tool_calls_and_responses():
    assert render_chat(MULTI, [WEATHER, TIME], add_generation_prompt=True) == MULTI_EXPECTED


def test_tools_without_system_message():
    out = render_chat([{"role": "user", "content": "Hi"}], [WEATHER, TIME])
    assert out.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert out == TOOLS_SYSTEM.replace("You are a helpful assistant.\n\n", "") + "<|im_start|>user\nHi<|im_end|>\n"


def test_enable_thinking_false():
    msgs = [{"role": "user", "content": "Hi"}]
    expected = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert render_chat(msgs, add_generation_prompt=True, enable_thinking=False) == expected
    # thinking on (default or explicit): the prompt ends at the assistant header
    assert render_chat(msgs, add_generation_prompt=True) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(msgs, add_generation_prompt=True, enable_thinking=True) == render_chat(
        msgs, add_generation_prompt=True
    )


def test_earlier_turn_reasoning_stripped_but_current_tool_loop_kept():
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nold\n</think>\n\na1"},
        {"role": "user", "content": "q2"},
        {
            "role": "assistant",
            "content": "<think>\nnew\n</think>\n\n",
            "tool_calls": [{"name": "get_time", "arguments": {}}],
        },
        {"role": "tool", "content": "12:00"},
    ]
    expected = (
        "<|im_start|>user\nq1<|im_end|>\n"
        "<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nnew\n</think>\n\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render_chat(msgs, add_generation_prompt=True) == expected


@pytest.mark.parametrize(
    "messages,tools,kwargs,expected",
    [
        (PLAIN, None, {"add_generation_prompt": True}, PLAIN_EXPECTED),
        (MULTI, [WEATHER, TIME], {"add_generation_prompt": True}, MULTI_EXPECTED),
    ],
)
def test_tokenizer_apply_chat_template(qwen_tokenizer_hf, messages, tools, kwargs, expected):
    tok = qwen_tokenizer_hf
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    assert text == expected
    enc = tok.apply_chat_template(messages, tools=tools, tokenize=True, **kwargs)
    ids = enc["input_ids"] if not isinstance(enc, list) else enc
    assert ids == tok.encode(expected, add_special_tokens=False)
    assert ids[:1] == [151644]  # <|im_start|>, no BOS
    plain = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False, **kwargs)
    assert plain == ids


def test_tokenizer_enable_thinking_false(qwen_tokenizer_hf):
    text = qwen_tokenizer_hf.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_verl_continuous_token_builder_matches_full_render(qwen_tokenizer_hf):
    """verl's incremental multi-turn tokenization (Qwen3 builder) equals the full-template tokenization."""
    pytest.importorskip("verl")
    from verl.utils.tokenizer.chat_template import initialize_system_prompt, initialize_turn_separator
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from envace.envs.base import ToolCall
    from envace.toolcall import parse_tool_calls, render_assistant_text

    tok = qwen_tokenizer_hf
    assert initialize_system_prompt(tok) == []  # Qwen3: no default system prompt
    assert initialize_turn_separator(tok) == [198]  # "\n" after <|im_end|>
    builder = create_continuous_token_builder(tok, hf_model_type="qwen3")
    assert type(builder).__name__ == "QwenContinuousTokenBuilder"

    tools = [WEATHER, TIME]
    msgs = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Paris?"}]
    ids = builder.build_initial_tokens(msgs, tools=tools)
    assert ids == tok.apply_chat_template(
        msgs, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )

    generated = render_assistant_text(
        "", [ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_time", {})], "plan"
    )
    ids = builder.merge_assistant_tokens(ids, tok.encode(generated + "<|im_end|>", add_special_tokens=False)).token_ids
    assistant = parse_tool_calls(generated).to_message()
    before = msgs + [assistant]
    after = before + [{"role": "tool", "content": '{"temp": 18}'}, {"role": "tool", "content": "12:00"}]
    ids = builder.merge_context_tokens(before, after, ids, tools=tools).token_ids
    full = tok.apply_chat_template(after, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == full
