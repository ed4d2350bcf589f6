"""Tool calling: rendering tools into the prompt (native templates and the fallback prompt), and parsing
the formats real templates teach back into OpenAI tool_calls."""

from __future__ import annotations

import json

import pytest

from pd.chat.renderer import FALLBACK_TOOLS_PROMPT, PromptRenderer
from pd.chat.toolcalls import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolStreamFilter,
    parser_for_template,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

# Qwen2.5-Instruct's chat template (Hermes-style tool calls), as shipped in its tokenizer_config.json.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The tool part of Llama 3.1/3.2-Instruct's template: JSON calls with "parameters", results as ipython.
LLAMA31_TEMPLATE_EXCERPT = """{%- if tools is not none %}{{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n" }}{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}{%- endif %}{%- for message in messages %}{%- if message.role == "ipython" or message.role == "tool" %}{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}{%- elif 'tool_calls' in message %}{{- '<|python_tag|>' }}{%- endif %}{%- endfor %}"""

MISTRAL_TEMPLATE_EXCERPT = """{%- if tools is not none %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{%- endif %}{%- if message.tool_calls %}[TOOL_CALLS][{%- for tc in message.tool_calls %}{{ tc|tojson }}{%- endfor %}]{%- endif %}"""


@pytest.fixture(scope="module")
def tokenizer():
    from pd.frontend.coordinator import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


# ---- parsers ---------------------------------------------------------------------------------------


def test_hermes_single_and_parallel_calls():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
    )
    out = HermesParser().parse(text)
    assert out.content == "Let me check."
    assert [c.name for c in out.tool_calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.arguments) for c in out.tool_calls] == [{"city": "Paris"}, {"city": "Lyon"}]
    assert all(c.id.startswith("call_") for c in out.tool_calls)
    assert len({c.id for c in out.tool_calls}) == 2
    d = out.tool_calls[0].to_openai()
    assert d["type"] == "function" and set(d["function"]) == {"name", "arguments"}


def test_hermes_unterminated_call_and_string_arguments():
    out = HermesParser().parse('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}')
    assert out.content is None
    assert json.loads(out.tool_calls[0].arguments) == {"x": 1}


def test_hermes_broken_json_stays_content():
    text = '<tool_call>\n{"name": "f", "arguments": {"x": </tool_call>'
    out = HermesParser().parse(text)
    assert out.tool_calls == () and out.content == text


def test_hermes_plain_text():
    out = HermesParser().parse("  Paris is sunny.  ")
    assert out.tool_calls == () and out.content == "Paris is sunny."


def test_llama3_json_calls():
    p = Llama3JsonParser()
    out = p.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert out.content is None and out.tool_calls[0].name == "get_weather"
    assert json.loads(out.tool_calls[0].arguments) == {"city": "Paris"}
    two = p.parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"y": 2}}')
    assert [c.name for c in two.tool_calls] == ["a", "b"]
    assert p.parse("The answer is 4.").tool_calls == ()
    assert p.parse('{"not": "a call"}').tool_calls == ()


def test_mistral_calls():
    p = MistralParser()
    out = p.parse('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert out.content == "Sure." and out.tool_calls[0].name == "get_weather"
    v11 = p.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}')
    assert json.loads(v11.tool_calls[0].arguments) == {"city": "Rome"}
    assert p.parse("[TOOL_CALLS] nonsense").tool_calls == ()


def test_parser_picked_from_template():
    assert isinstance(parser_for_template(QWEN25_TEMPLATE), HermesParser)
    assert isinstance(parser_for_template(LLAMA31_TEMPLATE_EXCERPT), Llama3JsonParser)
    assert isinstance(parser_for_template(MISTRAL_TEMPLATE_EXCERPT), MistralParser)
    assert isinstance(parser_for_template(None), HermesParser)


# ---- streaming hold-back -----------------------------------------------------------------------------


def _stream(parser, pieces):
    f = ToolStreamFilter(parser)
    sent = "".join(f.feed(p) for p in pieces)
    rest, calls = f.finish()
    return sent, rest, calls


def test_stream_filter_plain_text_passes_through():
    sent, rest, calls = _stream(HermesParser(), ["Hello", " <", "b>world", "</b>"])
    assert sent + rest == "Hello <b>world</b>" and calls == ()


def test_stream_filter_holds_a_call_split_over_pieces():
    pieces = [
        "Checking",
        ". <tool",
        '_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}\n</tool_call>',
    ]
    sent, rest, calls = _stream(HermesParser(), pieces)
    assert sent == "Checking. " and rest == ""
    assert calls[0].name == "get_weather"


def test_stream_filter_json_at_start():
    sent, rest, calls = _stream(Llama3JsonParser(), ["  ", '{"name": "f", ', '"parameters": {}}'])
    assert sent == "" and calls[0].name == "f"
    sent, rest, calls = _stream(Llama3JsonParser(), ["It is ", "{not json"])
    assert sent + rest == "It is {not json" and calls == ()


# ---- rendering ------------------------------------------------------------------------------------


def test_fallback_prompt_renders_tools_for_smollm2(tokenizer):
    r = PromptRenderer(tokenizer)
    assert not r.supports_tools  # SmolLM2's ChatML template has no tool support
    msgs = ({"role": "user", "content": "Weather in Paris?"},)
    plain = r.render_chat(msgs)
    p = r.render_chat(msgs, (WEATHER,), "auto")
    assert len(p.token_ids) > len(plain.token_ids)
    decoded = tokenizer.decode(list(p.token_ids))
    assert FALLBACK_TOOLS_PROMPT.splitlines()[0] in decoded and '"get_weather"' in decoded
    assert list(p.token_ids) == tokenizer(p.text, add_special_tokens=False)["input_ids"]
    # the tool signature's own tokens are in the rendered ids
    sig = tokenizer(json.dumps(WEATHER), add_special_tokens=False)["input_ids"]
    ids = list(p.token_ids)
    assert any(ids[i : i + len(sig)] == sig for i in range(len(ids) - len(sig) + 1))
    # tool_choice "none" renders no tools
    assert r.render_chat(msgs, (WEATHER,), "none").token_ids == plain.token_ids


def test_fallback_prompt_renders_tool_history(tokenizer):
    r = PromptRenderer(tokenizer)
    msgs = (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    )
    text = r.render_chat(msgs, (WEATHER,), "auto").text
    assert text.count("<|im_start|>system") == 1 and "Be brief." in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text


def test_native_template_renders_tools(tokenizer):
    r = PromptRenderer(tokenizer, QWEN25_TEMPLATE)
    assert r.supports_tools and isinstance(r.tool_parser, HermesParser)
    msgs = (
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    )
    p = r.render_chat(msgs, (WEATHER,), "auto")
    assert json.dumps(WEATHER, ensure_ascii=False) in p.text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in p.text  # arguments given as an object
    assert "<tool_response>\nsunny\n</tool_response>" in p.text
    assert p.text.count("# Tools") == 1  # the template's own block, no fallback prompt on top
    assert p.text.endswith("<|im_start|>assistant\n")


def test_forced_call_renders_the_auto_prompt(tokenizer):
    """A forced call is constrained by its schema (pd/chat/tool_choice.py), not by the prompt: vLLM's."""
    r = PromptRenderer(tokenizer)
    msgs = ({"role": "user", "content": "Weather in Paris?"},)
    auto = r.render_chat(msgs, (WEATHER,), "auto")
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        assert r.render_chat(msgs, (WEATHER,), choice) == auto


def test_no_chat_template_is_a_400(tokenizer):
    from pd.errors import ApiError

    class NoTemplate:
        chat_template = None

    r = PromptRenderer(NoTemplate())
    with pytest.raises(ApiError) as e:
        r.render_chat(({"role": "user", "content": "hi"},))
    assert e.value.status == 400 and "chat template" in e.value.message


def test_hermes_lenient_small_model_output():
    # SmolLM2-135M's greedy answer to a forced call: the outer brace never closed, the tag cut short
    text = '<tool_call>\n{"name": "get_weather", "arguments": \n{"city": "Paris"}\n</tool'
    out = HermesParser().parse(text)
    assert out.tool_calls[0].name == "get_weather" and json.loads(out.tool_calls[0].arguments) == {
        "city": "Paris"
    }


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_arguments_nested_past_the_recursion_limit_are_no_call(name):
    """Nesting deeper than the JSON decoder's recursion limit raised RecursionError out of the parser
    (a 500, issue 29): such an answer is text, in every format."""
    deep = "[" * 100_000 + "]" * 100_000
    text = f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>'
    out = PARSERS[name]().parse(text)
    assert out.tool_calls == () and out.content == text
