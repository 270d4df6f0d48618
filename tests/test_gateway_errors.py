"""Every way a request can fail at the gateway, over raw HTTP (status codes,
headers, OpenAI error objects) and the openai client: 400 for bad input (never
500), 404 for an unknown model, 401 without the configured key, 429 with
Retry-After when full, 503 while draining; and a client that goes away
mid-stream leaves no block held anywhere."""

from __future__ import annotations

import signal
import threading

import grpc
import httpx
import openai
import pytest
from gateway_fixtures import (
    SERVED,
    assert_error,
    iter_sse,
    module_cluster,
    start_gateway,
    start_workers,
    wait_blocks_free,
    wait_until,
)

from rpc.protos import common_pb2, generation_pb2

NUM_BLOCKS = 64  # 1024 tokens: the tiny model's whole context
# A decode worker with 24 blocks of 16 tokens has room for 384 tokens, less
# than the model's context: a 500-token prompt is valid but cannot fit.
SMALL_BLOCKS = 24
PROMPT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": "hello"}]
API_KEY = "s3cret-key"
OTHER_KEY = "another-tenants-key"


cluster, workers, gateway, no_leaks = module_cluster(NUM_BLOCKS)


@pytest.fixture(scope="module")
def http(gateway):
    with gateway.http() as h:
        yield h


# ---- 400 ---------------------------------------------------------------------------------

def _nested_schema(depth: int) -> str:
    schema = '{"type": "string"}'
    for _ in range(depth):
        schema = f'{{"type": "array", "items": {schema}}}'
    return schema


DEEP_SCHEMA, DEEPER_SCHEMA = _nested_schema(200), _nested_schema(3000)
DEEP_ARGUMENTS = "[" * 5000 + "]" * 5000
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

COMPLETION_CASES = {
    "temperature": ({"temperature": -1}, "temperature"),
    "top_p": ({"top_p": 2}, "top_p"),
    "n": ({"n": 0}, "n"),
    "max_tokens_0": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens_negative": ({"max_tokens": -3}, "max_tokens"),
    "top_k": ({"top_k": -2}, "top_k"),
    "presence_penalty": ({"presence_penalty": 3}, "presence_penalty"),
    "logprobs": ({"logprobs": 50}, "logprobs"),
    "temperature_type": ({"temperature": "hot"}, "temperature"),
    "stop_type": ({"stop": 5}, "stop"),
    "empty_stop": ({"stop": [""]}, "stop"),
    "empty_prompt": ({"prompt": ""}, "prompt"),
    "empty_prompt_list": ({"prompt": []}, "prompt"),
    "prompt_type": ({"prompt": {"a": 1}}, "prompt"),
    "token_out_of_vocab": ({"prompt": [1, 99999]}, "vocabulary"),
    "negative_token": ({"prompt": [1, -2]}, "prompt"),
    "suffix": ({"suffix": "the end"}, "suffix"),
    "best_of": ({"best_of": 3}, "best_of"),
    # Limits (gateway/config.py), checked before anything is allocated.
    "n_over_max_n": ({"n": 17}, "n must be at most 16"),
    "huge_n": ({"n": 1099511627776}, "n must be at most 16"),
    "too_many_stops": ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    "long_stop": ({"stop": ["x" * 1025]}, "stop string"),
    "too_many_prompts": ({"prompt": ["hi"] * 65}, "at most 64 prompts"),
    # Booleans are not integers, and integers must fit the workers' wire format.
    "boolean_n": ({"n": True}, "n"),
    "boolean_token": ({"prompt": [True]}, "prompt"),
    "best_of_0": ({"best_of": 0}, "best_of"),
    "huge_seed": ({"seed": 2**63}, "seed"),
    "huge_top_k": ({"top_k": 10**20}, "top_k"),
    "negative_stop_token": ({"stop_token_ids": [-1]}, "stop_token_ids"),
    "huge_stop_token": ({"stop_token_ids": [10**12]}, "stop_token_ids"),
    "float32_overflow": ({"temperature": 1e300}, "temperature"),
    "too_many_bad_words": ({"bad_words": [f"w{i}" for i in range(65)]}, "bad_words"),
    "long_bad_word": ({"bad_words": ["x" * 1025]}, "bad word"),
    "too_many_logit_biases": ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    "too_many_allowed_tokens": ({"allowed_token_ids": [1] * 100_000}, "allowed_token_ids"),
    "superscript_logit_bias_key": ({"logit_bias": {"²": 1}}, "token ids"),
    "arabic_digit_logit_bias_key": ({"logit_bias": {"٣": 1}}, "token ids"),
    "stream_options_without_stream": ({"stream_options": {"include_usage": True}},
                                      "stream_options"),
    # Nested past what llguidance reads safely (the string form: past what
    # Python's own JSON reader can).
    "deep_guided_json": ({"guided_json": DEEP_SCHEMA}, "nested more than 64"),
    "deeper_guided_json": ({"guided_json": DEEPER_SCHEMA}, "nested more than 64"),
}


@pytest.mark.parametrize("case", list(COMPLETION_CASES))
def test_completion_invalid_params_are_400(http, case):
    overrides, mention = COMPLETION_CASES[case]
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 4, **overrides}
    error = assert_error(http.post("/v1/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert mention in error["message"], error


def test_a_sampling_parameter_s_400_names_it(http):
    for field, value in (("temperature", -1), ("n", 17), ("seed", 2**63), ("min_tokens", 99),
                         ("stop", [""]), ("logit_bias", {"5": 1000}), ("best_of", 2),
                         ("suffix", "tail")):
        body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 4, field: value}
        error = assert_error(http.post("/v1/completions", json=body), 400)
        assert error["param"] == field and field in error["message"], (field, error)
    error = assert_error(http.post("/v1/chat/completions", json={
        "model": SERVED, "messages": MESSAGES, "max_completion_tokens": 0}), 400)
    assert error["param"] == "max_completion_tokens", error
    assert "max_completion_tokens" in error["message"], error


def test_non_finite_floats_are_400(http):
    for value in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        body = b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "temperature": %s}' % (
            SERVED.encode(), value)
        error = assert_error(http.post("/v1/completions", content=body,
                                       headers={"content-type": "application/json"}), 400)
        assert "temperature" in error["message"], (value, error)


def test_missing_prompt_is_400(http):
    error = assert_error(http.post("/v1/completions", json={"model": SERVED}), 400)
    assert error["param"] == "prompt"


CHAT_CASES = {
    "temperature": {"temperature": -1},
    "top_p": {"top_p": 2},
    "n": {"n": 0},
    "max_tokens": {"max_tokens": 0},
    "max_completion_tokens": {"max_completion_tokens": 0},
    "top_logprobs": {"logprobs": True, "top_logprobs": 30},
    "no_messages": {"messages": []},
    "no_messages_with_tools": {"messages": [], "tools": [
        {"type": "function", "function": {"name": "f"}}]},
    "messages_type": {"messages": "hello"},
    "bad_role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "image_part": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]},
    "tools": {"tools": [{"type": "function", "function": {"description": "no name"}}]},
    "huge_n": {"n": 10000},
    "too_many_messages": {"messages": [{"role": "user", "content": "hi"}] * 1025},
    "too_many_tools": {"tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                 for i in range(129)]},
    "top_logprobs_without_logprobs": {"top_logprobs": 2},
    "deep_tool_parameters": {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": DEEPER_SCHEMA}}], "tool_choice": "required"},
    "deep_tool_call_arguments": {"tools": [TOOL], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": DEEP_ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]},
}


# The field some of them name in ``param``.
CHAT_PARAMS = {"temperature": "temperature", "n": "n", "too_many_messages": "messages",
               "too_many_tools": "tools", "top_logprobs_without_logprobs": "top_logprobs"}


@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_chat_invalid_params_are_400(http, case):
    body = {"model": SERVED, "messages": MESSAGES, "max_tokens": 4, **CHAT_CASES[case]}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    if case in CHAT_PARAMS:
        assert error["param"] == CHAT_PARAMS[case], error


def test_invalid_params_through_the_openai_client(gateway):
    with gateway.client() as client:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=SERVED, messages=MESSAGES, temperature=-1)
        assert "temperature" in err.value.message
        # A stream that cannot start fails before any event, with the status.
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=SERVED, prompt=PROMPT, top_p=2, stream=True)


def test_prompt_longer_than_the_context(http):
    error = assert_error(http.post("/v1/completions", json={
        "model": SERVED, "prompt": [5] * 1100, "max_tokens": 4}), 400)
    assert "1024" in error["message"] and "1100" in error["message"], error
    # The limit counts the completion too.
    error = assert_error(http.post("/v1/completions", json={
        "model": SERVED, "prompt": [5] * 1000, "max_tokens": 100}), 400)
    assert "1024" in error["message"] and "1000" in error["message"], error
    error = assert_error(http.post("/v1/chat/completions", json={
        "model": SERVED, "messages": [{"role": "user", "content": "hello " * 1200}]}), 400)
    assert "1024" in error["message"], error


def test_a_text_far_over_the_context_is_refused_before_it_is_tokenized(http):
    # 4 x 1024 tokens x the toy vocabulary's longest spelling: no tokenizer
    # run could fit this text in the context, so none is run.
    for path, body in (("/v1/completions", {"prompt": "ab " * 400_000}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "ab " * 400_000}]})):
        error = assert_error(http.post(path, json={"model": SERVED, **body}), 400)
        assert "1024" in error["message"] and "characters" in error["message"], error


def test_a_long_text_is_refused_from_its_first_characters(http):
    # Under the bound above (a token can spell many characters), but every
    # character here is several byte tokens: its first 4096 characters
    # already hold far more than the context.
    error = assert_error(http.post("/v1/completions", json={
        "model": SERVED, "prompt": "日本" * 15_000}), 400)
    assert "first 4096 characters already have" in error["message"], error


def test_a_body_over_the_limit_is_413_and_the_gateway_stays_responsive(http):
    big = {"model": SERVED, "prompt": "a" * (8 << 20), "max_tokens": 1}
    error = assert_error(http.post("/v1/completions", json=big), 413)
    assert "larger than" in error["message"]
    # Announced as small, sent big (or chunked): counted as it arrives.
    def chunks():
        yield b'{"model": "x", "prompt": "'
        for _ in range(9):
            yield b"a" * (1 << 20)
        yield b'"}'
    assert_error(http.post("/v1/completions", content=chunks(),
                           headers={"content-type": "application/json"}), 413)
    assert http.get("/health").status_code == 200


def test_malformed_json_is_400(http):
    for body in (b"{not json", b'{"prompt": "x",}', b"", b"[1, 2]", b'"just a string"'):
        response = http.post("/v1/completions", content=body,
                             headers={"content-type": "application/json"})
        assert_error(response, 400)


def test_invalid_utf8_is_400(http):
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = http.post(path, content=b'{"prompt": "caf\xe9", "messages": []}',
                             headers={"content-type": "application/json"})
        error = assert_error(response, 400)
        assert "UTF-8" in error["message"]


def test_lone_surrogates_are_400(http):
    """Valid JSON, but no Unicode text: "\\ud800" escapes a half of a pair."""
    for path, body in (("/v1/completions", b'{"prompt": "a\\ud800b"}'),
                       ("/v1/completions", b'{"prompt": "x", "stop": ["\\udfff"]}'),
                       ("/v1/chat/completions",
                        b'{"messages": [{"role": "user", "content": "\\ud83d"}]}')):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
        assert_error(response, 400)


def test_wrong_content_type_is_not_500(http):
    response = http.post("/v1/completions", content=b'{"prompt": "x"}',
                         headers={"content-type": "text/plain"})
    assert 400 <= response.status_code < 500, response.text
    assert_error(response, response.status_code)


# ---- 404 ---------------------------------------------------------------------------------


def test_unknown_model_is_404(http, gateway):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        error = assert_error(http.post(path, json={"model": "gpt-17", **body}), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "gpt-17" in error["message"]
    with gateway.client() as client, pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=2)


def test_the_routers_own_errors_are_openai_errors(http):
    error = assert_error(http.get("/v1/nothing-here"), 404)
    assert error["type"] == "invalid_request_error"
    response = http.get("/v1/completions")
    assert_error(response, 405)
    assert "POST" in response.headers["allow"]
    assert_error(http.put("/v1/chat/completions", json={}), 405)


# ---- 401 ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_gateway(cluster, workers):
    return start_gateway(cluster, workers, "--api-key", f"{API_KEY},{OTHER_KEY}")


def test_api_key(keyed_gateway):
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 2}
    with keyed_gateway.http() as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                        {"Authorization": f"Basic {API_KEY}"}):
            error = assert_error(http.post("/v1/completions", json=body, headers=headers), 401)
            assert error["type"] == "authentication_error"
        assert_error(http.get("/v1/models"), 401)
        ok = http.post("/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200, ok.text
        # Liveness stays open for probes; the details, metrics and schema need the key.
        assert http.get("/health").json() == {"status": "ok"}
        keyed = {"Authorization": f"Bearer {OTHER_KEY}"}
        assert "workers" in http.get("/health", headers=keyed).json()
        for path in ("/metrics", "/openapi.json"):
            assert_error(http.get(path), 401)
            assert http.get(path, headers=keyed).status_code == 200
    with keyed_gateway.client(api_key="wrong") as client, \
            pytest.raises(openai.AuthenticationError):
        client.models.list()
    with keyed_gateway.client(api_key=API_KEY) as client:
        assert client.models.list().data[0].id == SERVED


def test_browsers_may_call_from_allowed_origins(keyed_gateway, cluster, workers):
    """CORS: a browser's preflight (no API key in it) is answered, and every
    answer, a 401 too, says which origin may read it; none where
    --allowed-origins is empty."""
    origin = {"Origin": "https://app.example"}
    preflight = {**origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 2}
    with keyed_gateway.http() as http:
        r = http.options("/v1/completions", headers=preflight)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "*"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        denied = http.post("/v1/completions", json=body, headers=origin)
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
        ok = http.post("/v1/completions", json=body,
                       headers={**origin, "Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
    only = start_gateway(cluster, workers, "--allowed-origins", "https://app.example")
    closed = start_gateway(cluster, workers, "--allowed-origins", "")
    try:
        with only.http() as http:
            assert http.options("/v1/completions", headers=preflight).headers[
                "access-control-allow-origin"] == "https://app.example"
            other = {**preflight, "Origin": "https://evil.example"}
            assert "access-control-allow-origin" not in http.options(
                "/v1/completions", headers=other).headers
        with closed.http() as http:
            r = http.post("/v1/completions", json=body, headers=origin)
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        only.proc.terminate()
        closed.proc.terminate()


def _generate(stub, key: str | None, request_id: str = "", max_tokens: int = 2):
    metadata = [("authorization", f"Bearer {key}")] if key else []
    request = generation_pb2.GenerateRequest(
        model=SERVED, text=PROMPT, request_id=request_id,
        params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0))
    return stub.Generate(request, metadata=metadata, timeout=60)


def test_api_key_on_grpc(keyed_gateway):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel, stub = keyed_gateway.generation_stub()
    with channel:
        for key in (None, "wrong"):
            with pytest.raises(grpc.RpcError) as err:
                list(_generate(stub, key))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.Abort(generation_pb2.GenerateAbortRequest(request_id="x"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(_generate(stub, API_KEY))
        assert replies[-1].finish_reason == "length"
        # Probes need no key.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_only_the_key_that_started_a_request_aborts_it(keyed_gateway):
    channel, stub = keyed_gateway.generation_stub()
    with channel:
        stream = _generate(stub, API_KEY, request_id="mine", max_tokens=900)
        next(stream)  # running now

        def abort(key):
            return stub.Abort(generation_pb2.GenerateAbortRequest(request_id="mine"),
                              metadata=[("authorization", f"Bearer {key}")], timeout=10).found

        assert not abort(OTHER_KEY)  # another tenant: as if it did not exist
        assert abort(API_KEY)
        rest = list(stream)
        assert rest[-1].finish_reason == "abort" and sum(len(r.token_ids) for r in rest) < 899


def test_keys_rotate_from_a_file_without_a_restart(cluster, workers, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# rotated by hand\nfirst-key\n")
    gateway = start_gateway(cluster, workers, "--api-key-file", str(keys))
    try:
        with gateway.http() as http:
            def status(key):
                return http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}
                                ).status_code

            assert (status("first-key"), status("second-key")) == (200, 401)
            keys.write_text("second-key\n")
            assert (status("first-key"), status("second-key")) == (401, 200)
            # Comments, indented or after a key, are never keys themselves.
            keys.write_text("  # revoked: old-key\nthird-key   # carol's\n")
            assert status("third-key") == 200
            assert status("# revoked: old-key") == status("third-key # carol's") == 401
    finally:
        gateway.proc.terminate()


def test_a_prompt_no_decode_worker_can_ever_hold_is_400(cluster, workers):
    # 500 prompt tokens fit the model's context but not the only decode
    # worker's 384-token cache: never servable here, so not a 429 to retry.
    # The context served is that cache's, and /v1/models says so.
    small = start_workers(cluster, ["decode"], SMALL_BLOCKS)
    gateway = start_gateway(cluster, [workers[0], *small])
    try:
        with gateway.http() as http:
            assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 384
            response = http.post("/v1/completions", json={
                "model": SERVED, "prompt": [5] * 500, "max_tokens": 4})
            error = assert_error(response, 400)
            assert "maximum context length is 384 tokens" in error["message"], error
            # A prompt that fits still works there, also without max_tokens:
            # the room left is the cache's, not the model's 2048 tokens.
            assert http.post("/v1/completions", json={"prompt": [5] * 300, "max_tokens": 4}
                             ).status_code == 200
            response = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["total_tokens"] == 384
        channel, stub = gateway.generation_stub()
        with channel, pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=[5] * 500),
                params=common_pb2.SamplingParams(max_tokens=4)), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        wait_blocks_free(small)
    finally:
        gateway.proc.terminate()
        small[0].proc.terminate()


# ---- 429 ---------------------------------------------------------------------------------


def _rejected(http) -> float:
    (line,) = [line for line in http.get("/metrics").text.splitlines()
               if line.startswith("tandem:requests_rejected_total ")]
    return float(line.split()[1])


def test_max_active_requests_is_429(cluster, workers):
    """Each prompt takes a place; a batch of prompts is admitted whole or
    refused whole, as one rejected request."""
    gateway = start_gateway(cluster, workers, "--max-active-requests", "2")
    long = {"model": SERVED, "prompt": PROMPT, "max_tokens": 900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    pair = {"model": SERVED, "prompt": [PROMPT, PROMPT], "max_tokens": 2}
    try:
        with gateway.http() as http, http.stream("POST", "/v1/completions", json=long) as r:
            assert r.status_code == 200
            events = iter_sse(r)
            first = next(events)
            assert first["choices"][0]["finish_reason"] is None
            # One place of two is taken: two prompts at once are refused.
            with gateway.http() as other:
                response = other.post("/v1/completions", json=pair)
                assert_error(response, 429)
                assert "retry-after" in response.headers
            rest = list(events)
            assert rest[-1] == "[DONE]"
            assert rest[-2]["choices"][0]["finish_reason"] == "length"
        with gateway.http() as http:
            assert _rejected(http) == 1  # one request, not one per prompt
            # Once it is done, there is room again: the refused batch kept no place.
            ok = http.post("/v1/completions", json=pair)
            assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
            ok = http.post("/v1/completions", json={**pair, "prompt": [PROMPT] * 3})
            assert_error(ok, 429)
            assert _rejected(http) == 2
    finally:
        gateway.proc.terminate()


# ---- 503 ---------------------------------------------------------------------------------


def test_draining_is_503_and_running_requests_finish(cluster, workers):
    # A grace period the 900-token stream surely ends within, on a loaded machine too.
    gateway = start_gateway(cluster, workers, "--grace", "60")
    events: list = []
    started = threading.Event()

    def long_stream() -> None:
        with gateway.http() as http, http.stream("POST", "/v1/completions", json={
                "model": SERVED, "prompt": PROMPT, "max_tokens": 900, "temperature": 0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            for event in iter_sse(r):
                events.append(event)
                started.set()

    reader = threading.Thread(target=long_stream)
    reader.start()
    try:
        assert started.wait(30), "the long request did not start"
        gateway.proc.popen.send_signal(signal.SIGTERM)
        with gateway.http() as http:
            wait_until(lambda: http.get("/health").status_code == 503, 5,
                       "/health to report draining")
            response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            error = assert_error(response, 503)
            assert "retry-after" in response.headers
            assert error["type"] == "service_unavailable"
        channel, stub = gateway.generation_stub()
        with channel, pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generation_pb2.GenerateRequest(
                text=PROMPT, params=common_pb2.SamplingParams(max_tokens=2)), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert reader.is_alive(), "the long request finished before the checks; make it longer"
        reader.join(60)
        assert not reader.is_alive()
        # The request that was running when the drain began ran to its end.
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 900
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        assert gateway.proc.popen.wait(30) == 0
    finally:
        gateway.proc.kill()
        reader.join(10)


# ---- client disconnect -------------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 900}),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2, "max_tokens": 400}),
])
def test_disconnect_mid_stream_frees_every_block(gateway, workers, path, body):
    with gateway.http() as http, http.stream("POST", path, json={
            "model": SERVED, "temperature": 0, "ignore_eos": True, "stream": True,
            **body}) as r:
        events = iter_sse(r)
        first = next(events)
        next(events)
        request_id = first["id"]
        # Leaving the block closes the connection mid-stream.
    wait_until(lambda: f"request {request_id} ended early" in gateway.output(), 10,
               "the gateway to abort the disconnected request")
    wait_blocks_free(workers)


def test_a_non_streaming_client_that_leaves_aborts_everywhere(gateway, workers):
    """A client that leaves before its answer (a non-streaming one gets no
    byte until the end) aborts the request: nothing runs on for nobody."""
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 900, "temperature": 0,
            "ignore_eos": True}
    ended = gateway.output().count("ended early")
    with gateway.http() as http, pytest.raises(httpx.TimeoutException):
        http.post("/v1/completions", json=body, timeout=0.3)  # gone long before 900 tokens
    wait_until(lambda: gateway.output().count("ended early") > ended, 10,
               "the gateway to abort the disconnected request")
    wait_blocks_free(workers)


def test_disconnect_through_the_openai_client(gateway, workers):
    with gateway.client() as client:
        stream = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=900,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        request_id = next(iter(stream)).id
        stream.close()
    wait_until(lambda: f"request {request_id} ended early" in gateway.output(), 10,
               "the gateway to abort the disconnected request")
    wait_blocks_free(workers)


def test_health_lists_workers(http, workers):
    body = http.get("/health").json()
    assert body["status"] == "ok"
    assert {w["address"] for w in body["workers"]} == {w.address for w in workers}
    assert all(w["healthy"] for w in body["workers"])


def test_errors_never_500_under_concurrency(http):
    # A burst of mixed good and bad requests: every answer is 200, 400 or 429.
    import concurrent.futures

    bodies = [{"prompt": PROMPT, "max_tokens": 3}, {"prompt": PROMPT, "top_p": 9},
              {"prompt": [5] * 1100, "max_tokens": 2}, {"model": "x", "prompt": PROMPT},
              {"prompt": [5] * 500, "max_tokens": 8}] * 4
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(lambda b: http.post("/v1/completions", json=b).status_code,
                              bodies))
    assert set(codes) <= {200, 400, 404, 429} and 200 in codes, codes



def test_the_gateway_imports_no_torch():
    """The gateway runs without torch: it uses only the engine's torch-free
    modules (config, tokenizer, sampling params, model resolution)."""
    import subprocess
    import sys

    code = "import sys, gateway.app; print('torch' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_workers_status_is_mapped_once():
    """A failed call to a worker becomes a retry (AttemptFailed) or the
    client's own error in one place; a worker's UNAVAILABLE is not the
    gateway draining (which is 503)."""
    from gateway.attempt_failure import AttemptFailed, worker_failure
    from rpc.errors import Draining, LayoutMismatch, Unavailable, from_rpc_error

    def failed(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                    details="why")

    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED):
        err = worker_failure(failed(code))
        assert isinstance(err, AttemptFailed) and err.code == code, code
        assert str(err) == f"{code.name}: why"
    assert isinstance(worker_failure(failed(grpc.StatusCode.INVALID_ARGUMENT)), ValueError)
    assert isinstance(worker_failure(failed(grpc.StatusCode.FAILED_PRECONDITION)),
                      LayoutMismatch)
    unavailable = from_rpc_error(failed(grpc.StatusCode.UNAVAILABLE))
    assert isinstance(unavailable, Unavailable) and not isinstance(unavailable, Draining)
