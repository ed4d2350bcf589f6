"""A forced tool_choice as vLLM does it: the schema the answer is constrained to, and the calls read back."""

from __future__ import annotations

import json

import pytest

from pd.api.protocol import parse_chat_request
from pd.chat.tool_choice import RequiredCalls, forced_schema, named_call, required_calls
from pd.errors import ApiError

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def test_named_choice_is_the_functions_parameters():
    assert forced_schema((CLOCK, WEATHER), NAMED, True) == CITY
    assert forced_schema((CLOCK,), {"type": "function", "function": {"name": "get_time"}}, True) == {
        "type": "object",
        "properties": {},
    }
    assert forced_schema((WEATHER,), "auto", True) is None and forced_schema((WEATHER,), "none", True) is None


def test_required_is_an_array_of_named_calls():
    schema = forced_schema((WEATHER, CLOCK), "required", True)
    assert schema is not None and schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"] for o in options] == [
        {"type": "string", "enum": ["get_weather"]},
        {"type": "string", "enum": ["get_time"]},
    ]
    assert options[0]["properties"]["parameters"] == CITY and options[0]["required"] == ["name", "parameters"]
    assert forced_schema((WEATHER, CLOCK), "required", False)["maxItems"] == 1  # type: ignore[index]


def test_required_lifts_defs_to_the_root():
    def tool(name: str, defs: dict) -> dict:
        params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": defs}
        return {"type": "function", "function": {"name": name, "parameters": params}}

    same = {"P": {"type": "integer"}}
    schema = forced_schema((tool("a", same), tool("b", same)), "required", True)
    assert schema is not None and schema["$defs"] == same
    assert all("$defs" not in o["properties"]["parameters"] for o in schema["items"]["anyOf"])
    with pytest.raises(ApiError) as e:
        forced_schema((tool("a", same), tool("b", {"P": {"type": "string"}})), "required", True)
    assert e.value.status == 400 and e.value.param == "tools[1].function.parameters"


def test_a_forced_choice_constrains_the_sampling():
    for choice in (NAMED, "required"):
        req = parse_chat_request({"messages": QUESTION, "tools": [WEATHER], "tool_choice": choice})
        so = req.sampling.params(8, None, 0).structured
        assert so is not None and so.kind == "json_schema"
        assert json.loads(so.spec) == forced_schema((WEATHER,), choice, True)
    auto = parse_chat_request({"messages": QUESTION, "tools": [WEATHER]})
    assert auto.sampling.structured is None


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"regex": "a+"}},
        {"guided_json": {"type": "object"}},
    ],
)
def test_a_forced_choice_with_a_structured_output_is_a_400(extra):
    for choice in (NAMED, "required"):
        with pytest.raises(ApiError) as e:
            parse_chat_request({"messages": QUESTION, "tools": [WEATHER], "tool_choice": choice, **extra})
        assert e.value.status == 400 and e.value.param == "tool_choice"
    parse_chat_request({"messages": QUESTION, "tools": [WEATHER], "tool_choice": "auto", **extra})


def test_named_call_keeps_the_text_as_its_arguments():
    call = named_call("get_weather", '{"city": "Paris"}')
    assert call.to_openai()["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call.id.startswith("call_")


def test_required_calls_stream_as_their_elements_close():
    text = '[{"name": "get_weather", "parameters": {"city": "Pa\\"]}ris"}}, {"name": "get_time", "parameters": {}}]'
    reader = RequiredCalls()
    closed_at = []
    for k, ch in enumerate(text):
        closed_at += [(k, c) for c in reader.feed(ch)]
    assert [k for k, _ in closed_at] == [text.index("}}, ") + 1, len(text) - 2]
    calls = [c for _, c in closed_at]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Pa"]}ris'}),
        ("get_time", {}),
    ]
    assert [(c.name, c.arguments) for c in required_calls(text)] == [(c.name, c.arguments) for c in calls]
    assert [c.name for c in required_calls(text[:-10])] == ["get_weather"]  # cut short: the closed ones
