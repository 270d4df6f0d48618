"""Real gateways in front of real workers on loopback, and the clients that
talk to them: the official ``openai`` client, raw HTTP (httpx) for what that
client hides (status codes, headers, server-sent events), and the generated
gRPC stubs.

Plain functions rather than conftest fixtures (tests/conftest.py is shared):
each test module wraps them in the module-scoped fixtures it wants.

The model is the tiny random Llama of ``engine_fixtures`` with its toy
byte-level tokenizer and a chat template: a worker starts in about two
seconds and makes a token in about a millisecond, so the gateway's own logic
is what these tests spend their time on. Its text is gibberish, often with
U+FFFD, which is what the streaming and stop-string paths must get right.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import grpc
import httpx
import openai
import pytest
import redis
from engine_fixtures import tiny_with_tokenizer
from httpx_sse import EventSource
from worker_fixtures import Worker, start_worker_set

from rpc.protos import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tandem.cluster import LocalCluster, Proc, free_port

SERVED = "tiny-llama"  # --served-model-name of every tiny-model gateway
REDIS_ENV = "TANDEM_TEST_REDIS_URL"


def tiny_model() -> Path:
    """The tiny model directory with a tokenizer (built once per process)."""
    return tiny_with_tokenizer("llama-gqa")


def redis_url(db: int) -> str:
    """The test Redis at database ``db`` (one per test module, so that worker
    registrations of one module never leak into another); skips the test
    when no Redis was given."""
    url = os.environ.get(REDIS_ENV)
    if not url:
        pytest.skip(f"{REDIS_ENV} is not set (make test starts a Redis server and sets it)")
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{db}"))


def flush_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


# ---- processes ------------------------------------------------------------------------


@dataclass
class Gateway:
    proc: Proc

    @property
    def address(self) -> str:
        return self.proc.address

    @property
    def url(self) -> str:
        return f"http://{self.proc.address}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def grpc_address(self) -> str:
        return self.proc.extra["grpc"]

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0,
                             timeout=kw.pop("timeout", 60.0), **kw)

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60.0), **kw)

    def generation_stub(self) -> tuple[grpc.Channel, generation_pb2_grpc.GenerationStub]:
        channel = grpc.insecure_channel(self.grpc_address)
        return channel, generation_pb2_grpc.GenerationStub(channel)

    def output(self) -> str:
        return self.proc.output()


def start_gateway(cluster: LocalCluster, workers: Iterable[Worker] = (), *extra: str,
                  model: Path | str | None = None, served: str | None = SERVED) -> Gateway:
    """A gateway process in front of ``workers`` (prefill ones as --prefill,
    decode and 'both' ones as --decode)."""
    args = ["--port", "0", "--grace", "10"]
    if model is None:
        model = tiny_model()
    if model != "default":
        args += ["--model", str(model)]
    if served:
        args += ["--served-model-name", served]
    for w in workers:
        args += ["--prefill" if w.proc.role == "prefill" else "--decode", w.address]
    return Gateway(cluster.start("gateway", [*args, *extra], timeout=60))


def start_workers(cluster: LocalCluster, roles: Iterable[str], num_blocks: int, *extra: str,
                  model: Path | str | None = None, metrics: bool = False) -> list[Worker]:
    """Worker processes of the tiny model, or of the bundled SmolLM2 for
    ``model="default"``."""
    if model == "default":
        procs = cluster.start_all([(role, ["--num-blocks", str(num_blocks), "--grace", "5",
                                           *extra]) for role in roles])
        return [Worker(proc, num_blocks) for proc in procs]
    model = tiny_model() if model is None else model
    return start_worker_set(cluster, [(role, extra) for role in roles], model, num_blocks,
                            metrics=metrics)


def sigkill(w: Worker | Gateway) -> None:
    proc = w.proc
    proc.popen.send_signal(signal.SIGKILL)
    proc.popen.wait(10)


# ---- workers' state -------------------------------------------------------------------


def info(address: str) -> worker_pb2.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)


def wait_until(predicate: Callable[[], object], timeout: float, what: str,
               interval: float = 0.05):
    """Poll until ``predicate()`` is truthy; returns its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_blocks_free(workers: Iterable[Worker], timeout: float = 15.0) -> None:
    """Until every KV block of every worker is free and nothing runs or waits
    there; fails with each worker's last Info otherwise."""
    workers = list(workers)
    deadline = time.monotonic() + timeout
    while True:
        infos = [info(w.address) for w in workers]
        if all(i.free_blocks == i.num_blocks and not i.num_running and not i.num_waiting
               for i in infos):
            return
        if time.monotonic() > deadline:
            state = "; ".join(f"{i.worker_id}: {i.free_blocks}/{i.num_blocks} free, "
                              f"{i.num_running} running, {i.num_waiting} waiting" for i in infos)
            raise AssertionError(f"blocks still held after {timeout}s: {state}")
        time.sleep(0.05)


# ---- HTTP -----------------------------------------------------------------------------


def assert_error(response: httpx.Response, status: int) -> dict:
    """``response`` is ``status`` with an OpenAI error object; returns the error."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    return error


def iter_sse(response: httpx.Response) -> Iterator[dict | str]:
    """The events of a server-sent event stream: parsed JSON, or "[DONE]"."""
    for event in EventSource(response).iter_sse():
        yield event.data if event.data == "[DONE]" else json.loads(event.data)


def stream_text(events: Iterable[dict | str]) -> str:
    """Concatenated text of index-0 choices (completions or chat deltas)."""
    out = []
    for e in events:
        if isinstance(e, str) or "error" in e:
            continue
        for c in e["choices"]:
            if c["index"] == 0:
                out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


def redis_record(url: str, request_id: str) -> dict[str, str]:
    import redis

    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return client.hgetall(f"tandem:req:{request_id}")
    finally:
        client.close()


class RedisMonitor:
    """Every hash write to request records while it runs (``redis-cli
    monitor``): the states a record went through, in order, even the ones
    that last a millisecond."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.lines: list[str] = []

    def __enter__(self) -> RedisMonitor:
        self._proc = subprocess.Popen(["redis-cli", "-u", self.url, "monitor"],
                                      stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        # redis-cli prints OK once monitoring.
        wait_until(lambda: self.lines, 10, "redis-cli monitor to start")
        return self

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def __exit__(self, *exc) -> None:
        time.sleep(0.2)  # the gateway's last writes reach Redis
        # Then a command of our own: once MONITOR has shown it to us, every
        # write Redis ran before it has been read too, however slow the pipe.
        marker = f"monitor-end-{uuid.uuid4().hex}"
        subprocess.run(["redis-cli", "-u", self.url, "echo", marker], check=True,
                       capture_output=True, timeout=10)
        wait_until(lambda: any(marker in line for line in self.lines), 10,
                   "redis-cli monitor to catch up")
        self._proc.terminate()
        self._proc.wait(10)
        self._reader.join(10)

    def writes(self, request_id: str) -> list[dict[str, str]]:
        """The field/value pairs of each HSET of the request's record."""
        key = f"tandem:req:{request_id}"
        out = []
        for line in self.lines:
            _, _, command = line.partition("] ")
            if not command.startswith('"HSET"'):
                continue
            args = shlex.split(command)
            if args[1] != key:
                continue
            out.append(dict(zip(args[2::2], args[3::2])))
        return out

    def states(self, request_id: str) -> list[str]:
        """The states written, without repeats of the same state in a row."""
        states: list[str] = []
        for w in self.writes(request_id):
            if "state" in w and (not states or states[-1] != w["state"]):
                states.append(w["state"])
        return states


needs_redis_server = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="needs Debian's redis-server (make test installs it)")


class RedisProcess:
    """A throwaway redis-server on a fixed port, to stop and start again
    (the suite's shared Redis must stay up). A context manager: started on
    entry, stopped and its directory removed on exit."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir], stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __enter__(self) -> RedisProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def cluster_fixture():
    """A module fixture: the processes its tests start, stopped at its end.
    Use as ``cluster = cluster_fixture()``."""

    @pytest.fixture(scope="module")
    def cluster():
        with LocalCluster() as c:
            yield c

    return cluster


# The requests the OpenAI-client test modules share.
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})
PROMPT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": "hello tandem"}]


def openai_fixtures():
    """Module fixtures beside ``module_cluster``'s gateway: the official
    ``openai`` client on it, and the tiny model's tokenizer. Use as
    ``client, tokenizer = openai_fixtures()``."""

    @pytest.fixture(scope="module")
    def client(gateway):
        with gateway.client() as c:
            yield c

    @pytest.fixture(scope="module")
    def tokenizer():
        from engine.tokenizer import Tokenizer

        return Tokenizer(tiny_model())

    return client, tokenizer


def traced_cluster_fixture():
    """Module fixtures: a trace file, and a cluster whose every process writes
    its spans there. Use as ``trace_file, cluster = traced_cluster_fixture()``."""

    @pytest.fixture(scope="module")
    def trace_file(tmp_path_factory):
        return tmp_path_factory.mktemp("traces") / "spans.jsonl"

    @pytest.fixture(scope="module")
    def cluster(trace_file):
        with LocalCluster(env={"TANDEM_TRACE_FILE": str(trace_file)}) as c:
            yield c

    return trace_file, cluster


def redis_db_fixture(db: int):
    """A module fixture: the test Redis at database ``db``, emptied first.
    Use as ``url = redis_db_fixture(DB)``."""

    @pytest.fixture(scope="module")
    def url():
        url = redis_url(db)
        flush_redis(url)
        return url

    return url


def module_cluster(num_blocks: int, roles: Iterable[str] = ("prefill", "decode")):
    """The module-scoped fixtures most gateway tests share: a cluster, its
    tiny-model workers, a gateway in front of them, and a check after every
    test that every block on every worker is free again. Use as

        cluster, workers, gateway, no_leaks = module_cluster(NUM_BLOCKS)
    """
    cluster = cluster_fixture()

    @pytest.fixture(scope="module")
    def workers(cluster):
        return start_workers(cluster, list(roles), num_blocks)

    @pytest.fixture(scope="module")
    def gateway(cluster, workers):
        return start_gateway(cluster, workers)

    @pytest.fixture(autouse=True)
    def no_leaks(workers):
        yield
        wait_blocks_free(workers)

    return cluster, workers, gateway, no_leaks


def assert_layer_spans(trace_file: Path, request_id: str, span_name: str, num_layers: int,
                       num_chunks: int) -> dict:
    """The trace of a prompt sent layer by layer in ``num_chunks`` chunks:
    one ``span_name`` span per layer per chunk, each one block further and
    starting after that layer computed it (``prefill.layer``), all children
    of the transfer's span, which this returns."""
    from rpc.tracing import read_trace_file

    def named(name: str) -> list[dict]:
        return [s for s in read_trace_file(trace_file) if s["name"] == name]

    def send() -> dict | None:
        return next((s for s in named("kv_transfer.send")
                     if s["attributes"]["request_id"] == request_id), None)

    span = wait_until(send, 20, "the transfer's span")
    sends = [s for s in named(span_name) if s["trace_id"] == span["trace_id"]]
    computed = [s for s in named("prefill.layer") if s["trace_id"] == span["trace_id"]]
    assert {s["parent_id"] for s in sends + computed} == {span["span_id"]}
    for layer in range(num_layers):
        mine = sorted((s for s in sends if s["attributes"]["layer"] == layer),
                      key=lambda s: s["start"])
        assert [s["attributes"]["blocks_upto"] for s in mine] == list(range(1, num_chunks + 1))
        done = sorted(s["end"] for s in computed if s["attributes"]["layer"] == layer)
        assert len(done) == num_chunks
        assert all(w["start"] >= end for w, end in zip(mine, done))
    return span
