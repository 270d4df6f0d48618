"""Tensor parallelism across hosts: a worker's leader (node 0) and a follower
node started as separate OS processes, as on two machines, meeting at the
address and port their flags give, serve the tokens of one process; the
leader is not ready (nor registered) before the follower joined; each side
fails cleanly, in bounded time, when the other never comes, disagrees or
goes away.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import signal
import socket
import struct
import time

import numpy as np
import pytest
import redis
from gateway_fixtures import redis_url
from tiny_models import build_tiny_model
from worker_fixtures import Gateway, Worker, params, start_worker, worker_args

from engine.batch import StepBatch
from engine.parallel.wire import (
    WireError,
    decode_command,
    encode_command,
    recv_frame,
    send_frame,
)
from tandem import LLM, SamplingParams
from tandem.cluster import LocalCluster, free_port

DB = 12
NUM_BLOCKS = 64


def _master_addr() -> str:
    """127.0.0.2 where it can be bound (Linux: all of 127/8 is loopback), so
    that a leader listening on 127.0.0.1 regardless of its flags could not
    be reached."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
        return "127.0.0.2"
    except OSError:
        return "127.0.0.1"


MASTER = _master_addr()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_tiny_model("llama-gqa", tmp_path_factory.mktemp("mntp"))[0])


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 11, 29)]


GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(model):
    llm = LLM(model, dtype="float32", num_blocks=NUM_BLOCKS)
    try:
        outs = llm.generate(_prompts(), SamplingParams(**GREEDY), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.engine.shutdown()


def _group_args(model: str, port: int, node_rank: int, *extra: str) -> list[str]:
    return worker_args(model, NUM_BLOCKS, "-tp", "2", "--nnodes", "2", "--node-rank",
                       str(node_rank), "--master-addr", MASTER, "--master-port", str(port),
                       *extra)


def _wait_for_line(cluster: LocalCluster, index: int, text: str, timeout: float = 120.0):
    """The ``index``-th process the cluster started, once its output has ``text``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(cluster.procs) > index and text in cluster.procs[index].output():
            return cluster.procs[index]
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in the output of process {index}")


def _port_open(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


async def test_two_nodes_serve_the_tokens_of_one_and_end_together(model, expected):
    url = redis_url(DB)
    store = redis.Redis.from_url(url)
    store.flushdb()
    port, grpc_port = free_port(MASTER), free_port()
    with LocalCluster() as cluster, concurrent.futures.ThreadPoolExecutor(1) as pool:
        # The leader first: it loads, then waits for rank 1 without serving.
        starting = pool.submit(cluster.start, "both", _group_args(
            model, port, 0, "--port", str(grpc_port), "--state-url", url))
        leader_proc = _wait_for_line(cluster, 0, "waiting at")
        assert not store.keys("tandem:worker:*"), "registered before its group formed"
        assert not _port_open(f"127.0.0.1:{grpc_port}"), "serving before its group formed"
        follower = cluster.start("both", _group_args(model, port, 1))
        assert starting.result(timeout=120) is leader_proc
        leader = Worker(leader_proc, NUM_BLOCKS)
        (key,) = store.keys("tandem:worker:*")
        assert json.loads(store.get(key))["address"] == leader.address  # the leader alone
        assert "TANDEM_READY node" in follower.output() and _port_open(follower.address)
        prefill = start_worker(cluster, "prefill", model, NUM_BLOCKS)

        async with Gateway() as gw:
            p = params(**GREEDY)
            got = [await gw.colocated(leader, f"r{i}", prompt, p)
                   for i, prompt in enumerate(_prompts())]
            assert [c.token_ids for c in got] == expected
            # KV from another worker lands in blocks split over the two nodes.
            moved = await gw.disaggregated(Worker(prefill.proc, NUM_BLOCKS), leader, "kv",
                                           _prompts()[1], p)
            assert moved.token_ids == expected[1]
            await gw.wait_idle([leader])
            # A node told to stop keeps its ranks for the leader's steps (its drain).
            follower.popen.send_signal(signal.SIGTERM)
            again = await gw.colocated(leader, "after-sigterm", _prompts()[0], p)
            assert again.token_ids == expected[0] and follower.alive

        leader_proc.popen.kill()  # the leader's host goes away
        assert follower.popen.wait(60) == 1
        assert "the leader at" in follower.output() and "went away" in follower.output()
    store.close()


def test_two_ranks_on_each_of_two_nodes(tmp_path):
    """Four ranks, two per node: the leader (the offline engine here) spawns
    rank 1 beside it; the other node runs ranks 2 and 3 (one of them in a
    process of its own). Stopping the engine stops that node, cleanly."""
    model = str(build_tiny_model("llama-gqa", tmp_path, num_key_value_heads=4)[0])
    greedy = SamplingParams(**GREEDY)
    one = LLM(model, dtype="float32", num_blocks=NUM_BLOCKS)
    try:
        expected = [o.outputs[0].token_ids for o in one.generate(_prompts(), greedy,
                                                                  use_tqdm=False)]
    finally:
        one.engine.shutdown()
    port = free_port(MASTER)
    with LocalCluster() as cluster, concurrent.futures.ThreadPoolExecutor(1) as pool:
        node = pool.submit(cluster.start, "both", worker_args(
            model, NUM_BLOCKS, "-tp", "4", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", MASTER, "--master-port", str(port)))
        llm = LLM(model, dtype="float32", num_blocks=NUM_BLOCKS, tensor_parallel_size=4,
                  nnodes=2, master_addr=MASTER, master_port=port)
        try:
            assert [p.name for p in llm.engine.runner.followers.procs] == ["tandem-tp1"]
            got = llm.generate(_prompts(), greedy, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in got] == expected
        finally:
            llm.engine.shutdown()
        follower = node.result(timeout=60)
        assert follower.popen.wait(30) == 0  # the leader stopped the group
        assert "stopped the group" in follower.output()


def test_a_follower_lost_while_idle_stops_the_leader(model):
    """No step needs the follower: the leader sees its connection end, stops
    serving and exits non-zero, for its supervisor to restart the group."""
    port = free_port(MASTER)
    with LocalCluster() as cluster, concurrent.futures.ThreadPoolExecutor(1) as pool:
        starting = pool.submit(cluster.start, "both", _group_args(model, port, 0))
        follower = cluster.start("both", _group_args(model, port, 1))
        leader = starting.result(timeout=120)
        follower.popen.kill()
        assert leader.popen.wait(60) == 1
        assert "tensor-parallel rank 1 on" in leader.output() and "is gone" in leader.output()


def test_a_follower_that_never_comes_fails_the_leaders_start(model):
    port = free_port(MASTER)
    with LocalCluster() as cluster:
        with pytest.raises(RuntimeError, match="failed to start") as err:
            cluster.start("both", _group_args(model, port, 0, "--tp-join-timeout", "3"))
        assert cluster.procs[0].popen.wait(30) != 0
    message = str(err.value)
    assert "tensor-parallel ranks [1] (node 1) did not join" in message
    assert f"at {MASTER}:{port} within 3 s" in message


def test_a_follower_with_other_settings_is_refused_by_both_sides(model):
    port = free_port(MASTER)
    with LocalCluster() as cluster, concurrent.futures.ThreadPoolExecutor(1) as pool:
        follower = pool.submit(cluster.start, "both",
                               _group_args(model, port, 1, "--block-size", "8"))
        with pytest.raises(RuntimeError, match="failed to start") as err:
            cluster.start("both", _group_args(model, port, 0))
        assert "runs with other settings (block_size 8 there, 16 here)" in str(err.value)
        with pytest.raises(RuntimeError, match="failed to start") as refused:
            follower.result(timeout=60)
        assert "refused rank 1" in str(refused.value)


@pytest.mark.parametrize("flags,message", [
    (["-tp", "2", "--nnodes", "2"], "nnodes > 1 needs master_addr"),
    (["-tp", "3", "--nnodes", "2", "--master-addr", "h"], "must be a multiple of nnodes 2"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h"],
     r"node_rank must be in \[0, nnodes=2\)"),
    (["-tp", "2", "--nnodes", "2", "--master-addr", "h", "--master-port", "0"],
     "master_port must be in"),
    (["--tp-join-timeout", "0"], "tp_join_timeout must be positive"),
])
def test_bad_flags_are_refused_before_anything_loads(flags, message, capsys):
    from decode_service.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--role", "both", *flags])
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_the_commands_in_docs_deploy_md_form_one_group():
    """docs/deploy.md's two hosts: the flags parse, and the nodes agree."""
    import shlex
    from pathlib import Path

    from engine.cli_args import config_from_args
    from worker.main import parser

    doc = (Path(__file__).resolve().parent.parent / "docs" / "deploy.md").read_text()
    block = re.search(r"# host A .*?```", doc, re.S).group(0).replace("\\\n", " ")
    commands = [shlex.split(line)[3:] for line in block.splitlines()
                if line.startswith("python -m decode_service")]
    configs = [config_from_args(parser("", ["decode", "both"]).parse_args(c)) for c in commands]
    assert [c.node_rank for c in configs] == [0, 1]
    for c in configs:
        assert (c.nnodes, c.tensor_parallel_size, c.ranks_per_node) == (2, 8, 4)
        assert (c.master_addr, c.master_port, c.model) == (
            configs[0].master_addr, configs[0].master_port, configs[0].model)


def test_an_engine_is_never_a_follower_node(model):
    with pytest.raises(ValueError, match="runs only its ranks' model shards"):
        LLM(model, tensor_parallel_size=2, nnodes=2, node_rank=1, master_addr="h")


# ---- the wire: plain data, no pickle -------------------------------------------------------


def _batch() -> StepBatch:
    return StepBatch(
        input_ids=np.array([5, 6, 7, 8], dtype=np.int64),
        positions=np.array([0, 1, 2, 9], dtype=np.int64),
        slot_mapping=np.array([16, 17, 18, 41], dtype=np.int64),
        query_start_loc=np.array([0, 3, 4], dtype=np.int32),
        seq_lens=np.array([3, 10], dtype=np.int32),
        block_tables=np.array([[1, 0], [2, 3]], dtype=np.int32),
        num_decode_seqs=1,
    )


def test_commands_cross_the_wire_as_they_left():
    a, b = socket.socketpair()
    with a, b:
        for command in [("forward", _batch(), [[2, 3], [0, 1, 2]]),
                        ("read_kv", [4, 1], None), ("write_kv", [2], 3), None]:
            send_frame(a, *encode_command(command))
            got = decode_command(*recv_frame(b))
            if command is None or command[0] != "forward":
                assert got == command
                continue
            batch = got[1]
            for name, value in vars(command[1]).items():
                if isinstance(value, np.ndarray):
                    assert np.array_equal(getattr(batch, name), value)
                    assert getattr(batch, name).dtype == value.dtype
                    assert getattr(batch, name).flags.writeable
                else:
                    assert getattr(batch, name) == value
            assert got[2] == command[2]


@pytest.mark.parametrize("frame,message", [
    (b"\x80\x04\x95" + b"\0" * 9, "not a Tandem tensor-parallel peer"),  # a pickle
    (struct.pack(">4sII", b"TDT1", 3, 0) + b"[1]", "not a JSON object"),
    (struct.pack(">4sII", b"TDT1", 14, 0) + b'{"op":"exec"}\n', "unknown tensor-parallel"),
    (struct.pack(">4sII", b"TDT1", 4, 0) + b"{}", "closed"),  # cut short
])
def test_the_wire_refuses_what_is_not_a_command(frame, message):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame)
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(WireError, match=message):
            decode_command(*recv_frame(b))


def test_a_batch_field_that_cannot_travel_is_named():
    batch = _batch()
    batch.num_decode_seqs = object()
    with pytest.raises(TypeError, match="StepBatch.num_decode_seqs"):
        encode_command(("forward", batch, []))
