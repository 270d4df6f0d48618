"""The first token goes to the client as soon as the prefill worker returns
it, not after a round trip to the decode worker; a first token that ends the
request (EOS, a stop token or string, max_tokens 1) ends it with no Decode
call and no block left held; and what the client gets is what the offline
engine makes.

The gateway reaches its decode worker through a TCP proxy that delays every
byte from the gateway by ``DELAY`` seconds: a slow link, nothing mocked. The
prefill worker pushes KV to the decode worker directly. So a Decode call
reaches the decode worker ``DELAY`` after the gateway makes it, and a first
token that waited for it would reach the client after the decode worker's
``decode.generate`` span began; sent from the prefill's reply, it comes first.
Every process writes its spans to one file (TANDEM_TRACE_FILE).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from gateway_fixtures import SERVED, info, start_gateway, tiny_model, wait_until
from worker_fixtures import start_worker

from engine.sampling_params import SamplingParams
from rpc.tracing import read_trace_file
from tandem.cluster import LocalCluster

NUM_BLOCKS = 64
DELAY = 0.4  # seconds, gateway -> decode worker
LEAK_S = 5.0  # a request's blocks are back within this (their lease is 30 s)
PROMPT = "the quick brown fox"
PROMPTS = [PROMPT, "hello tandem", "once upon a time", "abc"]


class DelayingProxy:
    """Forwards TCP connections to ``target``; bytes from the client side
    arrive ``delay`` seconds late (in order, without slowing the stream
    down); bytes back are forwarded at once."""

    def __init__(self, target: str, delay: float) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.delay = delay
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop).result(10)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, client_r, client_w) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(self.host, self.port)
        except OSError:
            client_w.close()
            return
        pipes = [asyncio.ensure_future(self._pipe(client_r, server_w, self.delay)),
                 asyncio.ensure_future(self._pipe(server_r, client_w, 0.0))]
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for p in pipes:
            p.cancel()
        for w in (client_w, server_w):
            w.close()

    async def _pipe(self, reader, writer, delay: float) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            while data := await reader.read(65536):
                queue.put_nowait((loop.time() + delay, data))
            queue.put_nowait((loop.time() + delay, b""))

        reading = asyncio.ensure_future(read())
        try:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    return
                writer.write(data)
                await writer.drain()
        finally:
            reading.cancel()

    def close(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    trace_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    cluster = LocalCluster(env={"TANDEM_TRACE_FILE": str(trace_file)})
    proxy = None
    try:
        prefill = start_worker(cluster, "prefill", tiny_model(), NUM_BLOCKS)
        decode = start_worker(cluster, "decode", tiny_model(), NUM_BLOCKS)
        proxy = DelayingProxy(decode.address, DELAY)
        gateway = start_gateway(cluster, [prefill], "--decode", proxy.address)
        yield trace_file, gateway, decode
    finally:
        cluster.stop()
        if proxy is not None:
            proxy.close()


@pytest.fixture(scope="module")
def client(setup):
    with setup[1].client() as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    from tandem import LLM

    return LLM(str(tiny_model()), dtype="float32", num_blocks=256)


@pytest.fixture(autouse=True)
def no_leaks(setup):
    """Every block of the decode worker is free soon after a request's
    response has ended: well within ``LEAK_S``, far below the reservation's
    30 s lease, so the gateway's Abort did it. (The Abort itself crosses the
    proxy's ``DELAY`` and may land just after the response.)"""
    yield
    decode = setup[2]
    wait_until(lambda: _idle(decode.address), LEAK_S, "the decode worker's blocks back")


def _idle(address: str) -> bool:
    state = info(address)
    return (state.free_blocks, state.num_running, state.num_waiting) == (NUM_BLOCKS, 0, 0)


def _trace_of(trace_file, request_id: str) -> list[dict]:
    """The spans of the request's trace, once its gateway side has ended."""

    def find():
        spans = read_trace_file(trace_file)
        root = [s for s in spans if s["name"] == "gateway.route_and_stream"
                and s["attributes"].get("request_id") == request_id]
        if not root:
            return None
        return [s for s in spans if s["trace_id"] == root[0]["trace_id"]]

    return wait_until(find, 20, f"the trace of {request_id}")


def _offline(offline, prompt: str, **kw):
    return offline.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


# ---- the first token does not wait for the decode worker ---------------------------------


def test_first_token_reaches_the_client_before_the_decode_call_begins(setup, client, offline):
    trace_file = setup[0]
    arrivals = []  # (monotonic, wall-clock ns, chunk)
    stream = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=8,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        arrivals.append((time.monotonic(), time.time_ns(), chunk))
    first_at, first_ns, first = arrivals[0]
    second_at = arrivals[1][0]
    # Token 2 comes from the Decode call, which crossed the slow link after
    # token 1 had left: a first token that came from that call too would
    # arrive a step before token 2, not a link delay before it.
    assert second_at - first_at > 0.75 * DELAY, [a[0] - first_at for a in arrivals]

    spans = _trace_of(trace_file, first.id)
    (generate,) = [s for s in spans if s["name"] == "decode.generate"]
    assert generate["service"] == "tandem-decode"
    # The client had token 1 before the decode worker began the Decode call.
    assert first_ns < generate["start"], (generate["start"] - first_ns) / 1e9
    (prefill,) = [s for s in spans if s["name"] == "gateway.prefill"]
    (decode,) = [s for s in spans if s["name"] == "gateway.decode"]
    assert prefill["end"] <= decode["start"]

    want = _offline(offline, PROMPT, max_tokens=8, temperature=0, ignore_eos=True)
    assert "".join(c.choices[0].text for _, _, c in arrivals) == want.text
    assert arrivals[-1][2].choices[0].finish_reason == "length"


# ---- a first token that ends the request ------------------------------------------------


def _no_decode_call(trace_file, request_id: str) -> None:
    names = {s["name"] for s in _trace_of(trace_file, request_id)}
    assert "gateway.prefill" in names
    assert not names & {"gateway.decode", "decode.generate", "/tandem.v1.Worker/Decode"}, names


def _check_ends_at_first_token(setup, client, offline, prompt: str, api: dict,
                               offline_kw: dict) -> None:
    """``api`` ends the request at its first token: the same as the offline
    engine, streamed or not, with no Decode call."""
    trace_file = setup[0]
    want = _offline(offline, prompt, **offline_kw)
    assert len(want.token_ids) == 1, want  # the case is what it claims to be
    out = client.completions.create(model=SERVED, prompt=prompt, **api)
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == (want.text, want.finish_reason)
    assert out.usage.completion_tokens == 1
    assert out.usage.prompt_tokens == len(offline.engine.tokenizer.encode(prompt))
    _no_decode_call(trace_file, out.id)
    wait_until(lambda: _idle(setup[2].address), LEAK_S, "the decode worker's blocks back")

    chunks = list(client.completions.create(model=SERVED, prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **api))
    *body, usage = chunks
    assert "".join(c.choices[0].text for c in body) == want.text
    assert body[-1].choices[0].finish_reason == want.finish_reason
    assert usage.usage.completion_tokens == 1
    _no_decode_call(trace_file, body[0].id)


def test_max_tokens_1_ends_without_a_decode_call(setup, client, offline):
    for prompt in PROMPTS:
        _check_ends_at_first_token(setup, client, offline, prompt,
                                   dict(max_tokens=1, temperature=0),
                                   dict(max_tokens=1, temperature=0))
    assert _offline(offline, PROMPT, max_tokens=1, temperature=0).finish_reason == "length"


def test_stop_token_ends_without_a_decode_call(setup, client, offline):
    first = _offline(offline, PROMPT, max_tokens=1, temperature=0).token_ids[0]
    kw = dict(max_tokens=10, temperature=0, stop_token_ids=[first])
    _check_ends_at_first_token(setup, client, offline, PROMPT,
                               dict(max_tokens=10, temperature=0,
                                    extra_body={"stop_token_ids": [first]}), kw)
    assert _offline(offline, PROMPT, **kw).stop_reason == first


def test_stop_string_ends_without_a_decode_call(setup, client, offline):
    for prompt in ("once upon a time", "abc"):  # first tokens "eeik", " attention"
        text = _offline(offline, prompt, max_tokens=1, temperature=0).text
        stop = text[1:3]  # inside the first token's text
        for include in (False, True):
            kw = dict(max_tokens=10, temperature=0, stop=[stop],
                      include_stop_str_in_output=include)
            _check_ends_at_first_token(
                setup, client, offline, prompt,
                dict(max_tokens=10, temperature=0, stop=[stop],
                     extra_body={"include_stop_str_in_output": include}), kw)
            assert _offline(offline, prompt, **kw).finish_reason == "stop"


def test_eos_ends_without_a_decode_call(setup, client, offline):
    eos = offline.engine.eos_token_ids
    # A seed that samples EOS first (the tiny random model rarely picks it greedily).
    for start in range(0, 2000, 200):
        outs = offline.generate([PROMPT] * 200, [
            SamplingParams(max_tokens=1, temperature=3.0, seed=s)
            for s in range(start, start + 200)], use_tqdm=False)
        seeds = [start + i for i, o in enumerate(outs) if o.outputs[0].token_ids[0] in eos]
        if seeds:
            break
    else:
        pytest.skip("no seed samples EOS first")
    kw = dict(max_tokens=10, temperature=3.0, seed=seeds[0])
    _check_ends_at_first_token(setup, client, offline, PROMPT, kw, kw)
    assert _offline(offline, PROMPT, **kw).finish_reason == "stop"


# ---- the same text and tokens as before -------------------------------------------------


def test_greedy_text_and_tokens_are_the_offline_engines(client, offline):
    for prompt in PROMPTS:
        for stop in ([], None):
            want = _offline(offline, prompt, max_tokens=12, temperature=0, ignore_eos=True,
                            logprobs=2)
            if stop is None:
                # A stop string that never matches but holds back text from
                # token 1 on: what the first chunk held back comes out once.
                stop = [want.text[:3] + "\x01" + "never" * 6]
            out = client.completions.create(model=SERVED, prompt=prompt, max_tokens=12,
                                            temperature=0, stop=stop or None, logprobs=2,
                                            extra_body={"ignore_eos": True})
            choice = out.choices[0]
            assert choice.text == want.text
            assert out.usage.completion_tokens == len(want.token_ids) == 12
            assert choice.logprobs.token_logprobs == pytest.approx(
                [lp[t] for t, lp in zip(want.token_ids, want.logprobs)], abs=1e-4)
            chunks = list(client.completions.create(
                model=SERVED, prompt=prompt, max_tokens=12, temperature=0, stop=stop or None,
                logprobs=2, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}))
            *body, usage = chunks
            assert "".join(c.choices[0].text for c in body) == want.text
            # One logprob per token: the first token's comes once, on the first chunk.
            streamed = [v for c in body if c.choices[0].logprobs
                        for v in c.choices[0].logprobs.token_logprobs]
            assert streamed == pytest.approx(choice.logprobs.token_logprobs, abs=1e-6)
            assert len(body[0].choices[0].logprobs.token_logprobs) == 1
            if stop:
                assert body[0].choices[0].text == ""  # held back, sent later
            assert usage.usage.completion_tokens == 12


def test_stop_string_after_the_first_token(client, offline):
    want = _offline(offline, PROMPT, max_tokens=20, temperature=0, ignore_eos=True)
    stop = want.text[2:6]  # spans tokens after the first
    ref = _offline(offline, PROMPT, max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
    assert ref.finish_reason == "stop" and len(ref.token_ids) > 1
    chunks = list(client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=20,
                                            temperature=0, stop=[stop], stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    *body, usage = chunks
    assert "".join(c.choices[0].text for c in body) == ref.text
    assert body[-1].choices[0].finish_reason == "stop"
    assert usage.usage.completion_tokens == len(ref.token_ids)


def test_n_2_sends_each_first_token_once(client, offline):
    kw = dict(max_tokens=6, temperature=1.5, seed=7, ignore_eos=True)
    want = offline.generate([PROMPT], SamplingParams(n=2, **kw), use_tqdm=False)[0].outputs
    chunks = list(client.completions.create(
        model=SERVED, prompt=PROMPT, n=2, max_tokens=6, temperature=1.5, seed=7, logprobs=1,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    *body, usage = chunks
    for i in (0, 1):
        mine = [c.choices[0] for c in body if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == want[i].text
        assert sum(len(c.logprobs.token_logprobs) for c in mine if c.logprobs) == 6
    assert usage.usage.completion_tokens == 12
