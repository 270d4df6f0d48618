"""The official ``openai`` client against a real gateway in front of a prefill
and a decode worker: completions, chat, streaming, n, stop strings, seeds,
logprobs, usage, /v1/models; colocated mode gives the same greedy text; and
one smoke test on the real SmolLM2."""

from __future__ import annotations

import json

import openai
import pytest
from gateway_fixtures import (
    GREEDY,
    MESSAGES,
    PROMPT,
    SERVED,
    module_cluster,
    openai_fixtures,
    start_gateway,
    start_workers,
    wait_blocks_free,
)
from worker_fixtures import metric

from tandem.cluster import LocalCluster

NUM_BLOCKS = 64

cluster, workers, gateway, no_leaks = module_cluster(NUM_BLOCKS)
client, tokenizer = openai_fixtures()


def test_models(client, gateway):
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED]
    assert models.data[0].object == "model"
    assert client.models.retrieve(SERVED).id == SERVED
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"


def test_completion(client, tokenizer):
    out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=12, **GREEDY)
    assert out.object == "text_completion" and out.model == SERVED
    assert out.id.startswith("cmpl-")
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    assert isinstance(choice.text, str) and choice.text
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_completion_model_is_optional(client):
    # vLLM-style: a missing model means the served one.
    out = client.post("/completions", cast_to=object,
                      body={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert out["model"] == SERVED


def test_completion_token_id_prompt_and_batch(client, tokenizer):
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model=SERVED, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=SERVED, prompt=[PROMPT, "hello world"],
                                      max_tokens=6, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.completion_tokens == 12


def test_chat(client):
    out = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=10,
                                         **GREEDY)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 10


def test_streaming_chat_matches_non_streamed(client):
    full = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=40,
                                          **GREEDY)
    chunks = list(client.chat.completions.create(model=SERVED, messages=MESSAGES,
                                                 max_tokens=40, stream=True, **GREEDY))
    assert len(chunks) > 2
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert all(c.usage is None for c in chunks)


def test_streaming_completion_matches_non_streamed(client):
    full = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=40, **GREEDY)
    chunks = list(client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=40,
                                            stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_wire_format_is_openais(gateway):
    """The bytes of a stream, as OpenAI's servers send them: each event one
    `data: {json}` line and a blank line, no comments or other fields, and
    `data: [DONE]` last."""
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 5, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with gateway.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes()).decode()
    assert raw.endswith("\n\ndata: [DONE]\n\n") and "\r" not in raw
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: {") and "\n" not in event, event
        assert json.loads(event[len("data: "):])["object"] == "text_completion"


def test_n_2(client):
    out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=8, n=2,
                                    temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=8, n=2,
                                          temperature=1.0, seed=5,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1]
    chunks = list(client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=8,
                                                 n=2, temperature=1.0, seed=5, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert streamed == {c.index: c.message.content for c in chat.choices}


def _stop_string(text: str) -> tuple[str, str]:
    """A two-letter stop string from the middle of ``text``, and the text
    before its first occurrence."""
    for i in range(4, len(text) - 2):
        stop = text[i:i + 2]
        if stop.isascii() and stop.isalpha() and text.find(stop) == i:
            return stop, text[:i]
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings(client):
    reference = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=40,
                                          **GREEDY).choices[0].text
    stop, before = _stop_string(reference)
    out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=40, stop=[stop],
                                    **GREEDY)
    assert out.choices[0].text == before
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].stop_reason == stop  # vLLM's field: what stopped it
    chunks = list(client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=40,
                                            stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == before
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].stop_reason == stop
    included = client.completions.create(
        model=SERVED, prompt=PROMPT, max_tokens=40, stop=[stop], temperature=0,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert included.choices[0].text == before + stop


def test_seed_reproducibility(client):
    def sample(seed: int) -> list[str]:
        out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=16, n=2,
                                        temperature=1.5, seed=seed,
                                        extra_body={"ignore_eos": True})
        return [c.text for c in out.choices]

    first = sample(1234)
    assert sample(1234) == first
    # Streaming with the same seed samples the same tokens.
    chunks = list(client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=16, n=2,
                                            temperature=1.5, seed=1234, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert [
        "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in (0, 1)
    ] == first
    others = [sample(seed) for seed in (1, 2, 3)]
    assert any(o != first for o in others), "different seeds all gave the same samples"


def test_completion_logprobs(client):
    out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=6, logprobs=3,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert len(lp.text_offset) == 6 and lp.text_offset == sorted(lp.text_offset)
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0
        # Two tokens may decode to the same text (a lone byte is U+FFFD).
        assert 1 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(value, abs=1e-5)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=5,
                                         logprobs=True, top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.token, str)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    plain = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=3,
                                           logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    none = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=3,
                                          **GREEDY)
    assert none.choices[0].logprobs is None


def test_stream_usage(client, tokenizer):
    chunks = list(client.completions.create(
        model=SERVED, prompt=PROMPT, max_tokens=7, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in body)
    assert last.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert last.usage.completion_tokens == 7
    assert last.usage.total_tokens == last.usage.prompt_tokens + 7

    chat = list(client.chat.completions.create(
        model=SERVED, messages=MESSAGES, max_tokens=5, n=2, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 10
    non_streamed = client.chat.completions.create(model=SERVED, messages=MESSAGES,
                                                  max_tokens=5, **GREEDY)
    assert chat[-1].usage.prompt_tokens == non_streamed.usage.prompt_tokens

    # vLLM's continuous_usage_stats: every chunk carries the usage so far.
    for create, kw in ((client.completions.create, {"prompt": PROMPT}),
                       (client.chat.completions.create, {"messages": MESSAGES})):
        running = list(create(model=SERVED, max_tokens=5, stream=True, stream_options={
            "include_usage": True, "continuous_usage_stats": True}, **kw, **GREEDY))
        assert all(c.usage is not None for c in running)
        counts = [c.usage.completion_tokens for c in running]
        assert counts == sorted(counts) and counts[-1] == 5 and counts[0] <= 1
        assert {c.usage.prompt_tokens for c in running} == {running[-1].usage.prompt_tokens}


# ---- colocated mode ---------------------------------------------------------------------


def test_colocated_matches_disaggregated(cluster, client):
    both = start_workers(cluster, ["both"], NUM_BLOCKS)
    colocated = start_gateway(cluster, both)
    try:
        with colocated.client() as c2:
            for api in ("completions", "chat"):
                if api == "completions":
                    def ask(c, **kw):
                        return c.completions.create(model=SERVED, prompt=PROMPT, max_tokens=30,
                                                    **GREEDY, **kw).choices[0].text
                else:
                    def ask(c, **kw):
                        return c.chat.completions.create(
                            model=SERVED, messages=MESSAGES, max_tokens=30, **GREEDY,
                            **kw).choices[0].message.content
                assert ask(c2) == ask(client)
            streamed = list(c2.completions.create(model=SERVED, prompt=PROMPT, max_tokens=30,
                                                  stream=True, **GREEDY))
            assert "".join(c.choices[0].text for c in streamed) == client.completions.create(
                model=SERVED, prompt=PROMPT, max_tokens=30, **GREEDY).choices[0].text
        wait_blocks_free(both)
    finally:
        colocated.proc.terminate()
        both[0].proc.terminate()


# ---- the real model ----------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_smoke():
    """The bundled SmolLM2-135M-Instruct, disaggregated, knows its capitals."""
    with LocalCluster() as c:
        workers = start_workers(c, ["prefill", "decode"], 64, model="default")
        gateway = start_gateway(c, workers, model="default", served=None)
        with gateway.client() as client:
            assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
            out = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", temperature=0, max_tokens=16,
                messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in out.choices[0].message.content
        wait_blocks_free(workers)


def test_gateway_metrics(client, gateway):
    client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=3, **GREEDY)
    with gateway.http() as http:
        text = http.get("/metrics").text
    assert (metric(text, "vllm:request_success_total", finished_reason="length") or 0) >= 1
    assert (metric(text, "vllm:e2e_request_latency_seconds_count") or 0) >= 1
    assert (metric(text, "vllm:time_to_first_token_seconds_count") or 0) >= 1
    assert metric(text, "vllm:num_requests_running") == 0
