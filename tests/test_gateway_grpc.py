"""The gateway's public gRPC API (tandem.v1.Generation) with a client
generated from the protos: streaming, the same validation messages as REST,
cancellation that frees every block, health and reflection."""

from __future__ import annotations

import threading

import grpc
import pytest
from gateway_fixtures import (
    SERVED,
    module_cluster,
    tiny_model,
    wait_blocks_free,
    wait_until,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.tokenizer import Tokenizer
from rpc.protos import common_pb2, generation_pb2

NUM_BLOCKS = 64
PROMPT = "the quick brown fox"
SERVICE = "tandem.v1.Generation"


cluster, workers, gateway, no_leaks = module_cluster(NUM_BLOCKS)


@pytest.fixture(scope="module")
def stub(gateway):
    channel, stub = gateway.generation_stub()
    with channel:
        yield stub


@pytest.fixture(scope="module")
def http(gateway):
    with gateway.http() as h:
        yield h


def greedy(max_tokens: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                     **kw)


def test_generate_streams_tokens_text_finish_and_usage(stub, http):
    request_id = "grpc-test-1"
    replies = list(stub.Generate(generation_pb2.GenerateRequest(
        request_id=request_id, text=PROMPT, params=greedy(12), model=SERVED), timeout=30))
    assert len(replies) > 1
    assert {r.request_id for r in replies} == {request_id}
    assert all(r.index == 0 for r in replies)
    token_ids = [t for r in replies for t in r.token_ids]
    assert len(token_ids) == 12
    reasons = [r.finish_reason for r in replies]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    last = replies[-1]
    prompt_len = len(Tokenizer(tiny_model()).encode(PROMPT))
    assert last.HasField("usage")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_len, 12)
    assert not any(r.HasField("usage") for r in replies[:-1])
    text = "".join(r.text for r in replies)
    rest = http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}).json()
    assert text == rest["choices"][0]["text"]


def test_generate_from_token_ids_and_n(stub):
    ids = Tokenizer(tiny_model()).encode(PROMPT)
    by_text = list(stub.Generate(generation_pb2.GenerateRequest(text=PROMPT, params=greedy(6)),
                                 timeout=30))
    by_ids = list(stub.Generate(generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=ids), params=greedy(6)), timeout=30))
    assert [t for r in by_ids for t in r.token_ids] == [t for r in by_text for t in r.token_ids]
    assert by_ids[0].request_id.startswith("grpc-")  # the gateway named it

    replies = list(stub.Generate(generation_pb2.GenerateRequest(
        text=PROMPT, params=common_pb2.SamplingParams(n=2, max_tokens=5, seed=3,
                                                      ignore_eos=True)), timeout=30))
    per_index = {0: 0, 1: 0}
    for r in replies:
        per_index[r.index] += len(r.token_ids)
    assert per_index == {0: 5, 1: 5}
    assert sorted(r.index for r in replies if r.finish_reason) == [0, 1]
    assert replies[-1].usage.completion_tokens == 10
    assert sum(r.HasField("usage") for r in replies) == 1


def test_prompt_logprobs_and_stop_reasons_as_rest_gives_them(stub, http):
    ids = Tokenizer(tiny_model()).encode(PROMPT)
    replies = list(stub.Generate(generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=ids), params=greedy(4, prompt_logprobs=2)),
        timeout=30))
    scored = replies[0].prompt_logprobs
    assert [p.token_id for p in scored] == ids[1:]
    assert not any(r.prompt_logprobs for r in replies[1:])
    rest = http.post("/v1/completions", json={
        "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "prompt_logprobs": 2}).json()["choices"][0]["prompt_logprobs"]
    assert [round(p.logprob, 4) for p in scored] == [
        round(entry[str(t)]["logprob"], 4) for t, entry in zip(ids[1:], rest[1:])]
    assert all(len(p.top_token_ids) >= 2 for p in scored)

    free = [t for r in stub.Generate(generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=ids), params=greedy(4)), timeout=30)
            for t in r.token_ids]
    stopped = list(stub.Generate(generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=ids),
        params=greedy(4, stop_token_ids=[free[1]])), timeout=30))
    last = stopped[-1]
    assert (last.finish_reason, last.stop_token_id, last.stop_reason) == ("stop", free[1], "")
    assert last.HasField("stop_token_id")


def test_default_max_tokens_is_16(stub):
    replies = list(stub.Generate(generation_pb2.GenerateRequest(
        text=PROMPT, params=common_pb2.SamplingParams(temperature=0.0, ignore_eos=True)),
        timeout=30))
    assert replies[-1].usage.completion_tokens == 16


LONG = [5] * 1100  # the tiny model's context is 1024 tokens


@pytest.mark.parametrize("rest, params, prompt", [
    ({"temperature": -1}, dict(temperature=-1.0), None),
    ({"top_p": 2}, dict(top_p=2.0), None),
    ({"top_k": -5}, dict(top_k=-5), None),
    ({"min_p": 1.5}, dict(min_p=1.5), None),
    ({"min_tokens": 20, "max_tokens": 4}, dict(min_tokens=20, max_tokens=4), None),
    ({"max_tokens": 16}, dict(max_tokens=16), LONG),
    ({"max_tokens": 16}, dict(max_tokens=16), [7, 100000]),
], ids=["temperature", "top_p", "top_k", "min_p", "min_tokens", "too_long", "vocab"])
def test_invalid_argument_has_the_rest_message(stub, http, rest, params, prompt):
    body = {"prompt": prompt if prompt is not None else PROMPT, **rest}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]

    request = generation_pb2.GenerateRequest(params=common_pb2.SamplingParams(**params))
    if prompt is None:
        request.text = PROMPT
    else:
        request.token_ids.ids.extend(prompt)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == message


def test_a_request_id_over_256_characters_is_invalid(stub):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generation_pb2.GenerateRequest(
            request_id="x" * 257, text=PROMPT, params=greedy(2)), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "256" in err.value.details()


def test_too_long_message_states_limit_and_length(stub):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=LONG), params=greedy(16)), timeout=30))
    assert "1024" in err.value.details() and "1100" in err.value.details()


def test_a_message_over_the_body_limit_is_resource_exhausted(stub):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generation_pb2.GenerateRequest(text="a" * (9 << 20),
                                                          params=greedy(1)), timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_empty_prompt_and_unknown_model(stub, http):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generation_pb2.GenerateRequest(params=greedy(4)), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generation_pb2.GenerateRequest(text=PROMPT, model="no-such-model",
                                                          params=greedy(4)), timeout=30))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    rest = http.post("/v1/completions", json={"prompt": PROMPT, "model": "no-such-model"})
    assert rest.status_code == 404
    assert err.value.details() == rest.json()["error"]["message"]


def test_cancel_aborts_on_every_worker(stub, gateway, workers):
    request_id = "grpc-cancel-1"
    call = stub.Generate(generation_pb2.GenerateRequest(
        request_id=request_id, text=PROMPT, params=greedy(900)), timeout=60)
    received = [next(call), next(call)]
    call.cancel()
    assert all(not r.finish_reason for r in received)
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    # The gateway saw the request end early (not finish), and no worker keeps a block.
    wait_until(lambda: f"request {request_id} ended early" in gateway.output(), 10,
               "the gateway to log the cancelled request")
    wait_blocks_free(workers)


def test_abort_rpc_ends_a_running_stream(stub, workers):
    request_id = "grpc-abort-1"
    call = stub.Generate(generation_pb2.GenerateRequest(
        request_id=request_id, text=PROMPT, params=greedy(900)), timeout=60)
    first = next(call)
    assert not first.finish_reason
    rest: list = []
    errors: list = []

    def drain() -> None:
        try:
            rest.extend(call)
        except grpc.RpcError as exc:
            errors.append(exc)

    reader = threading.Thread(target=drain)
    reader.start()
    stub.Abort(generation_pb2.GenerateAbortRequest(request_id=request_id), timeout=10)
    reader.join(30)
    assert not reader.is_alive(), "the stream did not end after Abort"
    tokens = len(first.token_ids) + sum(len(r.token_ids) for r in rest)
    assert tokens < 900
    # The stream ends with the abort as its finish reason, or with an error status.
    assert errors or rest[-1].finish_reason == "abort"
    wait_blocks_free(workers)


def test_abort_rpc_ends_every_completion_of_n(stub, workers):
    request_id = "grpc-abort-n2"
    call = stub.Generate(generation_pb2.GenerateRequest(
        request_id=request_id, text=PROMPT, params=greedy(400, n=2)), timeout=60)
    next(call)
    found = stub.Abort(generation_pb2.GenerateAbortRequest(request_id=request_id), timeout=10)
    assert found.found
    rest = list(call)
    assert sorted(r.index for r in rest if r.finish_reason == "abort") == [0, 1]
    assert sum(len(r.token_ids) for r in rest) < 799
    assert not stub.Abort(generation_pb2.GenerateAbortRequest(request_id="no-such-request"),
                          timeout=10).found
    wait_blocks_free(workers)


def test_health(gateway):
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_generation(gateway):
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        names = {s.name for s in replies[0].list_services_response.service}
        assert SERVICE in names and "grpc.health.v1.Health" in names
        # The service's descriptor is served too, so grpcurl can call it.
        replies = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol=SERVICE)]), timeout=10))
        assert replies[0].file_descriptor_response.file_descriptor_proto


def test_request_ids_that_could_pass_for_another_or_forge_a_log_line_are_refused(stub):
    for bad in ("job#0", "line\nFAKE LOG LINE", "with space", "caf\u00e9"):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generation_pb2.GenerateRequest(
                request_id=bad, text=PROMPT, params=greedy(2)), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert "request_id must be printable ASCII" in err.value.details()


def test_a_request_named_like_anothers_completion_runs_beside_it(stub, workers):
    """Completion 0 of "pair" runs on the workers as "pair#0": "pair-0", a
    request of its own, no longer meets it there (one of the two was refused
    as "already in use", and the refusal's cleanup aborted the other)."""
    both = stub.Generate(generation_pb2.GenerateRequest(
        request_id="pair", text=PROMPT, params=greedy(40, n=2)), timeout=60)
    other = list(stub.Generate(generation_pb2.GenerateRequest(
        request_id="pair-0", text=PROMPT, params=greedy(8)), timeout=60))
    replies = list(both)
    assert other[-1].finish_reason == "length"
    assert sorted(r.finish_reason for r in replies if r.finish_reason) == ["length", "length"]
    assert [sum(len(r.token_ids) for r in replies if r.index == i) for i in (0, 1)] == [40, 40]
    wait_blocks_free(workers)


def test_an_abort_that_finds_the_request_ends_it(stub, workers):
    """Abort answered found=True, but had reached the workers before the
    request's calls there: the request ran on to its length."""
    for i in range(20):
        request_id = f"abort-race-{i}"
        call = stub.Generate(generation_pb2.GenerateRequest(
            request_id=request_id, text=PROMPT, params=greedy(400)), timeout=60)
        while not stub.Abort(generation_pb2.GenerateAbortRequest(request_id=request_id),
                             timeout=10).found:
            pass
        replies = list(call)
        assert replies[-1].finish_reason == "abort", (i, replies[-1].finish_reason)
        assert sum(len(r.token_ids) for r in replies) < 400
    wait_blocks_free(workers)


def test_max_tokens_left_unset_is_16_and_never_cut_to_fit(stub, http):
    long = [5] * (tiny_model_context(http) - 10)  # room for 10 tokens, not 16
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=long), params=common_pb2.SamplingParams()),
            timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "maximum context length" in err.value.details()
    replies = list(stub.Generate(generation_pb2.GenerateRequest(
        text=PROMPT, params=common_pb2.SamplingParams(ignore_eos=True)), timeout=30))
    assert sum(len(r.token_ids) for r in replies) == 16


def tiny_model_context(http) -> int:
    return http.get("/v1/models").json()["data"][0]["max_model_len"]
