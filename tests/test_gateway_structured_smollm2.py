"""The bundled SmolLM2-135M-Instruct behind a disaggregated gateway, driven by
the official ``openai`` client: ``chat.completions.parse`` with a pydantic
model, a few JSON Schemas through ``response_format``, and a tool call's
round trip (the call, the tool's result, the final answer), streamed and
not."""

from __future__ import annotations

import json

import jsonschema
import pytest
from gateway_fixtures import cluster_fixture, start_gateway, start_workers, wait_blocks_free
from pydantic import BaseModel, Field
from structured_schemas import SCHEMAS

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]

cluster = cluster_fixture()


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: float = Field(ge=0, le=50)


@pytest.fixture(scope="module")
def workers(cluster):
    return start_workers(cluster, ["prefill", "decode"], 64, "--dtype", "float32",
                         model="default")


@pytest.fixture(scope="module")
def client(cluster, workers):
    gateway = start_gateway(cluster, workers, model="default", served=None)
    with gateway.client() as c:
        yield c
    wait_blocks_free(workers)


def test_parse_with_a_pydantic_model(client):
    out = client.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=80, response_format=City,
        messages=[{"role": "user", "content": "Describe the city of Paris."}])
    city = out.choices[0].message.parsed
    assert isinstance(city, City), out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"


def test_schemas_through_response_format(client):
    for what, schema in SCHEMAS[::5]:
        out = client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=120,
            messages=[{"role": "user", "content": f"Give {what} as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": schema}})
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(client, stream):
    call_kw = {"model": MODEL, "temperature": 0, "max_tokens": 60, "tools": [WEATHER],
               "parallel_tool_calls": False}
    first = _answer(client, stream, messages=QUESTION, tool_choice="required", **call_kw)
    assert first["finish_reason"] == "tool_calls"
    (call,) = first["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    messages = [*QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"],
                 "content": json.dumps({"city": args["city"], "sky": "sunny", "celsius": 21})}]
    final = _answer(client, stream, messages=messages, tool_choice="none", **call_kw)
    assert final["content"] and not final["tool_calls"]
    assert final["finish_reason"] in ("stop", "length")


def _answer(client, stream: bool, **kw) -> dict:
    """content, tool_calls (as dicts) and finish_reason of one chat choice,
    put together from the stream's deltas when streaming."""
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        return {"content": choice.message.content, "tool_calls": calls,
                "finish_reason": choice.finish_reason}
    content, calls, reason = [], {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for d in choice.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": d.id, "type": "function",
                                               "function": {"name": None, "arguments": ""}})
            if d.function.name:
                entry["function"]["name"] = d.function.name
            entry["function"]["arguments"] += d.function.arguments or ""
        reason = choice.finish_reason or reason
    return {"content": "".join(content), "tool_calls": [calls[i] for i in sorted(calls)],
            "finish_reason": reason}
