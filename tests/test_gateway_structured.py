"""Structured outputs and tool calls through the gateway, on the tiny random
model (its text is whatever the grammar lets through, so these test the
plumbing, not the model): disaggregated = colocated = offline for
constrained requests, also after the decode worker serving a constrained
stream is killed; bad constraints and tool definitions are 400s naming the
field; tool_choice required and named give tool calls whose arguments parse,
streamed as incremental argument deltas."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from engine_fixtures import make_engine, run_to_completion
from gateway_fixtures import (
    SERVED,
    assert_error,
    cluster_fixture,
    iter_sse,
    redis_db_fixture,
    redis_record,
    sigkill,
    start_gateway,
    start_workers,
    stream_text,
    tiny_model,
    wait_blocks_free,
)

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

DB = 3
NUM_BLOCKS = 96
PROMPT = "the quick brown fox"
GREEDY = {"temperature": 0}
DIGITS = {"type": "object", "properties": {"digits": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": 150, "maxItems": 150}}, "required": ["digits"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
        "additionalProperties": False}}}
CONSTRAINED = [
    {"guided_regex": "[a-f]{3}-[0-9]{4}"},
    {"guided_choice": ["red", "green", "blue"]},
    {"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                             "maximum": 99}},
                     "required": ["n"], "additionalProperties": False}},
    {"structured_outputs": {"grammar": 'root ::= "<" [a-z]+ ">"'}},
    {"response_format": {"type": "json_object"}},
]

url = redis_db_fixture(DB)
cluster = cluster_fixture()


@pytest.fixture(scope="module")
def workers(cluster, url):
    return start_workers(cluster, ["prefill", "decode", "decode", "both"], NUM_BLOCKS,
                         "--state-url", url)


@pytest.fixture(scope="module")
def gateway(cluster, workers, url):
    return start_gateway(cluster, [w for w in workers if w.proc.role != "both"],
                         "--state-url", url)


@pytest.fixture(scope="module")
def colocated(cluster, workers):
    return start_gateway(cluster, [w for w in workers if w.proc.role == "both"])


@pytest.fixture(scope="module")
def offline():
    return make_engine(tiny_model(), num_blocks=NUM_BLOCKS)


def _offline_text(engine, extra: dict, max_tokens: int, **sampling) -> str:
    from gateway.protocol import CompletionRequest
    from gateway.structured import constraint_of

    spec = constraint_of(CompletionRequest(prompt=PROMPT, **extra))
    engine.add_request("ref", PROMPT, SamplingParams(max_tokens=max_tokens,
                                                     structured_outputs=spec, **sampling))
    return run_to_completion(engine)["ref"].outputs[0].text


@pytest.mark.parametrize("sampling", [GREEDY, {"temperature": 1.0, "seed": 7}])
def test_disaggregated_equals_colocated_equals_offline(gateway, colocated, offline, workers,
                                                       sampling):
    with gateway.client() as disagg, colocated.client() as coloc:
        for extra in CONSTRAINED:
            texts = [c.completions.create(model=SERVED, prompt=PROMPT, max_tokens=40,
                                          extra_body=extra, **sampling).choices[0].text
                     for c in (disagg, coloc)]
            texts.append(_offline_text(offline, extra, 40, **sampling))
            assert texts[0] == texts[1] == texts[2], (extra, texts)
        assert re.fullmatch("[a-f]{3}-[0-9]{4}", _offline_text(offline, CONSTRAINED[0], 40,
                                                                **sampling))
        # Chat, streamed and not, with OpenAI's response_format.
        fmt = {"type": "json_schema", "json_schema": {"name": "digits", "schema": DIGITS}}
        chat = {"model": SERVED, "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 400, "response_format": fmt, **sampling}
        answers = [c.chat.completions.create(**chat).choices[0].message.content
                   for c in (disagg, coloc)]
        answers.append(stream_text(
            {"choices": [{"index": 0, "delta": {"content": ch.choices[0].delta.content}}]}
            for ch in disagg.chat.completions.create(**chat, stream=True) if ch.choices))
        assert answers[0] == answers[1] == answers[2]
        jsonschema.validate(json.loads(answers[0]), DIGITS)
    wait_blocks_free([w for w in workers if w.proc.alive])


def test_constrained_stream_survives_decode_worker_death(gateway, workers, url, offline):
    """Kill the decode worker serving a constrained stream: the other one
    rebuilds the grammar state from the spec and the tokens so far, and the
    text is exactly the uninterrupted one."""
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 400, "guided_json": DIGITS,
            **GREEDY}
    reference = _offline_text(offline, {"guided_json": DIGITS}, 400, temperature=0)
    with gateway.http() as http, http.stream("POST", "/v1/completions",
                                             json={**body, "stream": True}) as r:
        events = iter_sse(r)
        received = [next(events) for _ in range(40)]
        rid = received[0]["id"]
        serving = next(w for w in workers
                       if w.worker_id == redis_record(url, rid)["decode_worker"])
        sigkill(serving)
        received += list(events)
    assert not any("error" in e for e in received if isinstance(e, dict)), received[-3:]
    assert received[-2]["choices"][0]["finish_reason"] == "stop"
    assert stream_text(received) == reference
    jsonschema.validate(json.loads(reference), DIGITS)
    assert redis_record(url, rid)["attempt"] == "2"
    wait_blocks_free([w for w in workers if w.proc.alive])


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"guided_json": {"type": "objectx"}}, "guided_json"),
    ("/v1/completions", {"guided_regex": "a(b"}, "guided_regex"),
    ("/v1/completions", {"guided_json": {"type": "object", "dependentSchemas": {"a": {}}}},
     "guided_json"),
    ("/v1/completions", {"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "loop", "schema": {"$ref": "#"}}}}, "response_format"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "parameters": {"type": "object"}}}]}, "tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objectx"}}}]}, "tools"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
])
def test_bad_constraints_are_400_naming_the_field(gateway, path, body, param):
    base = {"model": SERVED, "max_tokens": 5}
    base.update({"prompt": PROMPT} if path == "/v1/completions"
                else {"messages": [{"role": "user", "content": PROMPT}]})
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        error = assert_error(http.post(path, json={**base, **body}), 400)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_tool_calls_parse_streamed_and_not(gateway, workers, choice):
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "weather in Paris?"}],
            "tools": [WEATHER, TIME], "tool_choice": choice, "max_tokens": 200, **GREEDY}
    with gateway.client() as client:
        out = client.chat.completions.create(**chat)
        streamed = list(client.chat.completions.create(**chat, stream=True))
    message = out.choices[0]
    # The model's choice to call ends its turn with "tool_calls"; a call forced
    # by name with "stop", as OpenAI's and vLLM's.
    reason = "stop" if isinstance(choice, dict) else "tool_calls"
    assert message.finish_reason == reason
    calls = message.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(choice, dict):
        assert [c.function.name for c in calls] == ["get_time"]
    # Streamed: a header per call, then its arguments in pieces, adding up to the same calls.
    pieces: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for chunk in streamed:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id:
                names[delta.index] = delta.function.name
            pieces.setdefault(delta.index, []).append(delta.function.arguments or "")
    assert [names[i] for i in sorted(names)] == [c.function.name for c in calls]
    assert ["".join(pieces[i]) for i in sorted(pieces)] == [c.function.arguments for c in calls]
    assert max(len(p) for p in pieces.values()) > 2  # incremental, not one piece
    assert streamed[-1].choices[0].finish_reason == reason
    wait_blocks_free([w for w in workers if w.proc.alive])


def test_auto_tool_calls_found_by_the_hermes_parser(gateway, workers):
    """tool_choice auto: the gateway's parser (hermes, the default) finds the
    call in the text. A grammar makes the tiny model write one."""
    forced = ('Sure\\.\\n<tool_call>\\n\\{"name": "get_time", "arguments": '
              '\\{"zone": "[a-z]{3}"\\}\\}\\n</tool_call>')
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "time?"}],
            "tools": [WEATHER, TIME], "max_tokens": 80, **GREEDY,
            "extra_body": {"structured_outputs": {"regex": forced}}}
    with gateway.client() as client:
        out = client.chat.completions.create(**chat).choices[0]
        streamed = list(client.chat.completions.create(**chat, stream=True))
    assert out.finish_reason == "tool_calls" and out.message.content == "Sure."
    (call,) = out.message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    content = "".join(c.choices[0].delta.content or "" for c in streamed)
    arguments = "".join(d.function.arguments or "" for c in streamed
                        for d in c.choices[0].delta.tool_calls or [])
    assert content.strip() == "Sure." and arguments == call.function.arguments
    wait_blocks_free([w for w in workers if w.proc.alive])


def test_grpc_generate_takes_the_constraint(gateway, offline):
    """The public gRPC API carries the same spec; a bad one is INVALID_ARGUMENT."""
    import grpc

    from rpc.protos import common_pb2, generation_pb2

    def generate(request_id: str, kind: str, value: str) -> str:
        params = common_pb2.SamplingParams(
            max_tokens=40, temperature=0.0,
            structured_outputs=common_pb2.StructuredOutputs(kind=kind, value=value))
        request = generation_pb2.GenerateRequest(request_id=request_id, text=PROMPT,
                                                 params=params)
        return "".join(r.text for r in stub.Generate(request, timeout=60))

    channel, stub = gateway.generation_stub()
    with channel:
        text = generate("grpc-regex", "regex", "[a-f]{3}-[0-9]{4}")
        with pytest.raises(grpc.RpcError) as err:
            generate("grpc-bad", "regex", "a(b")
    assert text == _offline_text(offline, {"guided_regex": "[a-f]{3}-[0-9]{4}"}, 40,
                                 temperature=0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.regex" in err.value.details()


def test_a_grammar_that_allows_no_first_token_ends_alike_on_either_cluster(gateway, colocated,
                                                                          workers):
    """Disaggregated, the prefill worker refused it (a 400); on one worker it
    finished with grammar_dead_end. Now both finish so, and free the KV."""
    tokenizer = Tokenizer(tiny_model())
    [the] = tokenizer.encode(" the", add_special_tokens=False)[-1:]
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "guided_regex": "a+", "allowed_token_ids": [the]}
    for gw in (gateway, colocated):
        with gw.http() as http:
            response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("", "grammar_dead_end")
    wait_blocks_free([w for w in workers if w.proc.popen.poll() is None])  # one was killed
