"""Tool calls found in model text, whole and streamed piece by piece, and the
messages a chat template without tool support gets. No model: plain text in,
OpenAI-shaped calls out."""

from __future__ import annotations

import json

import pytest

from gateway.partial_json import scan_call
from gateway.protocol import ChatMessage
from gateway.tool_parsers import (
    Hermes,
    Llama3Json,
    Named,
    Required,
    ToolCallStream,
    finished_calls,
)
from gateway.tools import ToolChoice, chat_messages, parse_tools

HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "note": "a } and a \\" inside"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
LLAMA_TEXT = ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
              '{"name": "get_time", "parameters": {"zone": "CET"}}')
REQUIRED_TEXT = ('[{"name":"get_weather","parameters":{"city":"Paris","tags":["a","b"]}},'
                 '{"name":"get_time","parameters":{"zone":"CET"}}]')
CALLS = [("get_weather", None), ("get_time", {"zone": "CET"})]


def _check(calls):
    assert [c["function"]["name"] for c in calls] == [name for name, _ in CALLS]
    assert json.loads(calls[1]["function"]["arguments"]) == CALLS[1][1]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)


@pytest.mark.parametrize("parser, text, content", [
    (Hermes(), HERMES_TEXT, "Let me check."),
    (Llama3Json(), LLAMA_TEXT, None),
    (Required(), REQUIRED_TEXT, None),
])
def test_finished_text_gives_calls(parser, text, content):
    found, calls, complete = finished_calls(parser, text)
    assert found == content and complete
    _check(calls)
    assert json.loads(calls[0]["function"]["arguments"])["city"] == "Paris"


def test_text_without_calls_is_content():
    for parser in (Hermes(), Llama3Json()):
        assert finished_calls(parser, "Paris is sunny.") == ("Paris is sunny.", [], False)
    assert finished_calls(Named("f"), '{"a": 1}')[1][0]["function"] == {
        "name": "f", "arguments": '{"a": 1}'}


@pytest.mark.parametrize("parser, text", [
    (Hermes(), HERMES_TEXT), (Llama3Json(), LLAMA_TEXT), (Required(), REQUIRED_TEXT),
    (Hermes(), "No tools needed <tool here, just text."),
])
def test_streamed_deltas_add_up_to_the_finished_answer(parser, text):
    stream = ToolCallStream(parser)
    content, names, args = [], {}, {}
    for end in range(1, len(text) + 1):
        delta, entries = stream.feed(text[:end], final=end == len(text))
        content.append(delta)
        for e in entries:
            if "id" in e:
                names[e["index"]] = e["function"]["name"]
            args.setdefault(e["index"], []).append(e["function"]["arguments"])
        assert "<tool_call" not in "".join(content)
    expected_content, calls, _ = finished_calls(parser, text)
    assert "".join(content).strip() == (expected_content or "")
    assert [names[i] for i in sorted(names)] == [c["function"]["name"] for c in calls]
    assert ["".join(args[i]) for i in sorted(args)] == [c["function"]["arguments"]
                                                       for c in calls]
    if calls:
        assert max(len(a) for a in args.values()) > 3  # pieces, not one whole string


def _streamed(stream, text):
    content, entries = [], []
    for end in range(1, len(text) + 1):
        delta, new = stream.feed(text[:end], final=end == len(text))
        content.append(delta)
        entries += new
    return "".join(content), entries


WEATHER = frozenset({"get_weather"})


@pytest.mark.parametrize("text", [
    "I use <tool_call> tags like this.",
    "Sure. <tool_call>not json at all</tool_call> and more text",
    'Sure. <tool_call>{"name": "get_weather", "arguments": "{\\"city\\": 1}"}</tool_call>',
    'Sure. <tool_call>{"name": "nope", "arguments": {"city": "Paris"}}</tool_call>',
])
def test_what_is_not_a_call_stays_content(text):
    assert finished_calls(Hermes(), text, WEATHER) == (text, [], False)
    stream = ToolCallStream(Hermes(), WEATHER)
    assert _streamed(stream, text) == (text, [])
    assert not stream.called and not stream.complete


HERMES_BACKWARDS = ('Sure. <tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}'
                    '</tool_call>')
LLAMA_BACKWARDS = ('{"parameters": {"city": "Paris"}, "name": "get_weather"}; '
                   '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
REQUIRED_BACKWARDS = ('[{"arguments": {"city": "Paris"}, "name": "get_weather"}, '
                      '{"name": "get_weather", "arguments": {"city": "Oslo"}}]')


@pytest.mark.parametrize("parser, text, content, cities", [
    (Hermes(), HERMES_BACKWARDS, "Sure.", ["Paris"]),
    (Llama3Json(), LLAMA_BACKWARDS, None, ["Paris", "Oslo"]),
    (Required(), REQUIRED_BACKWARDS, None, ["Paris", "Oslo"]),
])
def test_a_call_with_its_keys_the_other_way_round(parser, text, content, cities):
    got, calls, _ = finished_calls(parser, text, WEATHER)
    assert got == content and [c["function"]["name"] for c in calls] == ["get_weather"] * len(cities)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == cities
    stream = ToolCallStream(parser, WEATHER)
    streamed, entries = _streamed(stream, text)
    assert streamed.strip() == (content or "") and stream.complete
    args = [""] * len(cities)
    for e in entries:
        args[e["index"]] += e["function"]["arguments"]
    assert [json.loads(a)["city"] for a in args] == cities
    # A backwards call not yet closed is not a call yet: nothing to name it by.
    assert scan_call(text, text.index("{")) is not None
    assert scan_call(text[:text.index("}") + 1], text.index("{")) is None


def _collected_like_streamed(parser, text, names):
    """The finished answer and the stream's deltas, added up, agree."""
    content, calls, complete = finished_calls(parser, text, names)
    stream = ToolCallStream(parser, names)
    streamed, entries = _streamed(stream, text)
    args: dict[int, str] = {}
    for e in entries:
        args[e["index"]] = args.get(e["index"], "") + e["function"]["arguments"]
    assert streamed.strip() == (content or "")
    assert [e["function"]["name"] for e in entries if "id" in e] == [
        c["function"]["name"] for c in calls]
    assert [args[i] for i in sorted(args)] == [c["function"]["arguments"] for c in calls]
    assert stream.complete == complete
    return content, calls, complete


def test_a_cut_off_call_is_a_call_as_far_as_it_got():
    """Cut off by max_tokens: the stream has sent the call's start, so the
    collected answer reports it too (finish_reason "length" tells)."""
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    content, calls, complete = _collected_like_streamed(Hermes(), text, WEATHER)
    assert content == "Sure." and not complete
    assert [c["function"] for c in calls] == [{"name": "get_weather",
                                               "arguments": '{"city": "Par'}]


def test_a_call_of_an_unknown_function_and_what_follows_is_content():
    """A good call, then one of a function the request does not have: the
    good one is a call, streamed and collected; the rest is content, in both."""
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    text = ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '</tool_call>' + bad)
    content, calls, complete = _collected_like_streamed(Hermes(), text, WEATHER)
    assert content == "Sure. " + bad and complete
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    llama = '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "nope", ' \
            '"parameters": {}}'
    content, calls, _ = _collected_like_streamed(Llama3Json(), llama, WEATHER)
    assert content == '{"name": "nope", "parameters": {}}' and len(calls) == 1


def test_a_call_whose_arguments_do_not_parse_is_not_complete():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>'
    content, calls, complete = _collected_like_streamed(Hermes(), text, WEATHER)
    assert content is None and len(calls) == 1 and not complete


def test_a_grammar_held_call_cut_short_is_still_a_call():
    (call,) = finished_calls(Named("get_weather"), '{"city": "Par')[1]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    content, calls, complete = finished_calls(Required(), REQUIRED_TEXT[:60])
    assert content is None and not complete and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_template_without_tools_gets_them_as_text():
    tools = parse_tools([{"type": "function", "function": {"name": "get_time"}}])
    messages = [ChatMessage(role="user", content="time?"),
                ChatMessage(role="assistant", content=None, tool_calls=[{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]),
                ChatMessage(role="tool", tool_call_id="call_1", content="12:00")]
    chatml = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
    out, shown = chat_messages(messages, tools, ToolChoice("auto"), chatml, Hermes())
    assert shown is None
    assert out[0]["role"] == "system" and '"get_time"' in out[0]["content"]
    assert finished_calls(Hermes(), out[2]["content"])[1][0]["function"]["name"] == "get_time"
    assert out[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}
    # A template that renders tools itself gets them, and the calls, as they are.
    out, shown = chat_messages(messages, tools, ToolChoice("auto"), "{{ tools }}", Hermes())
    assert shown == [tools[0].raw] and out[1]["tool_calls"][0]["function"]["arguments"] == {
        "zone": "CET"}
