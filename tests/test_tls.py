"""A TLS cluster (gateway, one prefill and one decode worker, each with its
own certificate from scripts/gen_certs.py, registered in Redis): the
official ``openai`` client over HTTPS and gRPC Generate over TLS complete
requests; workers refuse callers without a certificate from the cluster's
CA and plaintext callers; a ticket naming a peer that is not a registered
worker is refused before anything connects; the torch transport's store
listens only on the host it is given; bad TLS settings stop a start-up with
the reason."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from gateway_fixtures import (
    SERVED,
    cluster_fixture,
    redis_db_fixture,
    start_gateway,
    tiny_model,
    wait_until,
)
from worker_fixtures import params, start_worker

from engine.parallel.store import listening_store
from rpc.errors import PermissionDenied, Unavailable
from rpc.protos import common_pb2, generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from rpc.tls import TLSConfig
from tandem.cluster import free_port
from worker.peers import PeerPolicy
from worker.registry import PREFIX

ROOT = Path(__file__).resolve().parent.parent
DB = 9
NUM_BLOCKS = 32
PROMPT = "the quick brown fox"


def gen_certs(directory: Path, *extra: str) -> Path:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_certs.py"), str(directory),
                    "--name", "gateway", "--name", "prefill", "--name", "decode", *extra],
                   check=True, capture_output=True, timeout=60)
    return directory


def tls_flags(certs: Path, name: str) -> list[str]:
    return ["--tls-cert-file", str(certs / f"{name}.pem"),
            "--tls-key-file", str(certs / f"{name}-key.pem"),
            "--tls-ca-file", str(certs / "ca.pem")]


def mtls_channel(address: str, certs: Path, name: str = "client") -> grpc.Channel:
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(),
        private_key=(certs / f"{name}-key.pem").read_bytes(),
        certificate_chain=(certs / f"{name}.pem").read_bytes()))


url = redis_db_fixture(DB)
cluster = cluster_fixture()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    # tandem-internal: the name docker-compose.tls.yml checks peers against.
    return gen_certs(tmp_path_factory.mktemp("certs"), "--san", "tandem-internal")


@pytest.fixture(scope="module")
def workers(cluster, url, certs):
    return [start_worker(cluster, role, tiny_model(), NUM_BLOCKS, "--state-url", url,
                         *tls_flags(certs, role))
            for role in ("prefill", "decode")]


@pytest.fixture(scope="module")
def gateway(cluster, workers, url, certs):
    return start_gateway(cluster, workers, "--state-url", url, *tls_flags(certs, "gateway"))


@pytest.fixture(autouse=True)
def no_leaks(request, certs):
    """After each test, every block of every worker is free (asked over mTLS)."""
    yield
    if "workers" in request.fixturenames:
        workers = request.getfixturevalue("workers")

        def all_free() -> bool:
            for w in workers:
                with mtls_channel(w.address, certs) as channel:
                    i = worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(),
                                                                 timeout=10)
                if i.free_blocks != i.num_blocks or i.num_running or i.num_waiting:
                    return False
            return True

        wait_until(all_free, 15, "every block free on every worker")


# ---- clients over TLS ---------------------------------------------------------------


def test_openai_client_over_https(gateway, certs):
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    with httpx.Client(verify=ctx, timeout=60) as http, openai.OpenAI(
            base_url=f"https://{gateway.address}/v1", api_key="unused", max_retries=0,
            http_client=http) as client:
        out = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 8
        stream = client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": PROMPT}], max_tokens=6,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        reasons = [c.choices[0].finish_reason for c in stream if c.choices]
        assert reasons[-1] == "length"


def test_grpc_generate_over_tls(gateway, certs):
    creds = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
    with grpc.secure_channel(gateway.grpc_address, creds) as channel:
        replies = list(generation_pb2_grpc.GenerationStub(channel).Generate(
            generation_pb2.GenerateRequest(
                text=PROMPT, model=SERVED,
                params=common_pb2.SamplingParams(max_tokens=6, temperature=0.0,
                                                 ignore_eos=True)), timeout=30))
    assert sum(len(r.token_ids) for r in replies) == 6
    assert replies[-1].finish_reason == "length"


def test_gateway_can_require_client_certificates(cluster, workers, url, certs):
    """Off by default (API keys authenticate callers); --tls-client-ca-file
    asks REST and gRPC callers for a certificate that CA signed."""
    gw = start_gateway(cluster, workers, "--state-url", url, *tls_flags(certs, "gateway"),
                       "--tls-client-ca-file", str(certs / "ca.pem"))
    try:
        with_cert = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with_cert.load_cert_chain(certs / "client.pem", certs / "client-key.pem")
        with httpx.Client(verify=with_cert, timeout=30) as http:
            assert http.get(f"https://{gw.address}/v1/models").status_code == 200
        without = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        with httpx.Client(verify=without, timeout=30) as http, \
                pytest.raises(httpx.TransportError):
            http.get(f"https://{gw.address}/v1/models")
        no_cert = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
        with grpc.secure_channel(gw.grpc_address, no_cert) as channel, \
                pytest.raises(grpc.RpcError) as err:
            list(generation_pb2_grpc.GenerationStub(channel).Generate(
                generation_pb2.GenerateRequest(text=PROMPT, model=SERVED), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        gw.proc.terminate()


def test_plaintext_clients_are_refused(gateway, workers):
    with httpx.Client(timeout=10) as http, pytest.raises(httpx.TransportError):
        http.get(f"http://{gateway.address}/health")
    for address in (gateway.grpc_address, workers[0].address):
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_worker_refuses_callers_without_a_certificate_of_its_ca(workers, certs, tmp_path):
    address = workers[1].address
    with mtls_channel(address, certs) as channel:  # the cluster's client certificate: served
        assert worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(),
                                                        timeout=10).role == "decode"
    no_cert = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
    other = gen_certs(tmp_path / "other")
    stranger = grpc.ssl_channel_credentials(
        root_certificates=(certs / "ca.pem").read_bytes(),
        private_key=(other / "client-key.pem").read_bytes(),
        certificate_chain=(other / "client.pem").read_bytes())
    for creds in (no_cert, stranger):
        with grpc.secure_channel(address, creds) as channel, \
                pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_health_check_speaks_mtls(workers, certs):
    """As docker-compose.tls.yml runs it: TANDEM_TLS_* variables, the peer
    checked against a shared name rather than its address."""

    def check(**env: str) -> int:
        return subprocess.run([sys.executable, "-m", "rpc.healthcheck", workers[0].address],
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **env},
                              cwd=ROOT, capture_output=True, timeout=30).returncode

    mtls = {"TANDEM_TLS_CERT_FILE": str(certs / "prefill.pem"),
            "TANDEM_TLS_KEY_FILE": str(certs / "prefill-key.pem"),
            "TANDEM_TLS_CA_FILE": str(certs / "ca.pem")}
    assert check(**mtls) == 0
    assert check(**mtls, TANDEM_TLS_SERVER_NAME="tandem-internal") == 0
    assert check(**mtls, TANDEM_TLS_SERVER_NAME="elsewhere") == 1  # not in the certificate
    assert check() == 1  # plaintext


# ---- peers --------------------------------------------------------------------------


def test_ticket_naming_an_unregistered_peer_is_refused_before_connecting(workers, certs):
    prefill, decode = workers
    # A listener the ticket names: no connection may reach it.
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen()
    trap.settimeout(0.3)
    trap_address = f"127.0.0.1:{trap.getsockname()[1]}"
    tickets = [
        ("nobody", trap_address),  # no such worker
        (decode.worker_id, trap_address),  # a registered worker, not at that address
        (prefill.worker_id, prefill.address),  # registered, but not a decode worker
    ]
    with mtls_channel(prefill.address, certs) as channel, trap:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for worker_id, address in tickets:
            with pytest.raises(grpc.RpcError) as err:
                stub.Prefill(worker_pb2.PrefillRequest(
                    request_id=f"peer-{worker_id}", prompt_token_ids=[5, 6, 7],
                    params=params(max_tokens=2), ticket=worker_pb2.Ticket(
                        request_id=f"peer-{worker_id}", decode_worker_id=worker_id,
                        decode_address=address, block_ids=[0])), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
            assert "not a registered decode worker" in err.value.details()
        with pytest.raises(TimeoutError):
            trap.accept()
    # The torch transport cannot encrypt: under TLS a decode worker will not join a group.
    with mtls_channel(decode.address, certs) as channel, pytest.raises(grpc.RpcError) as err:
        worker_pb2_grpc.WorkerStub(channel).OpenTransferGroup(
            worker_pb2.OpenTransferGroupRequest(prefill_worker_id=prefill.worker_id,
                                                store_address="127.0.0.1:1", group_name="g"),
            timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_peer_policy(url):
    import redis.asyncio as redis

    client = redis.from_url(url)
    await client.set(PREFIX + "d1", '{"worker_id": "d1", "role": "decode", '
                                    '"address": "10.0.0.2:7000"}', ex=30)
    await client.set(PREFIX + "p1", '{"worker_id": "p1", "role": "prefill", '
                                    '"address": "10.0.0.3:7001"}', ex=30)
    await client.aclose()
    policy = PeerPolicy(["10.0.0.9:7000"], url)
    try:
        await policy.check_decode("d1", "10.0.0.2:7000")
        await policy.check_decode("anyone", "10.0.0.9:7000")  # a --peer
        await policy.check_store("p1", "10.0.0.3:45678")  # any port on its host
        await policy.check_store("x", "10.0.0.9:45678")  # a --peer's host
        for call in (policy.check_decode("d1", "10.0.0.2:7001"),
                     policy.check_decode("p1", "10.0.0.3:7001"),
                     policy.check_decode("nobody", "10.0.0.2:7000"),
                     policy.check_store("d1", "10.0.0.2:45678"),
                     policy.check_store("p1", "10.0.0.4:45678")):
            with pytest.raises(PermissionDenied, match="registered"):
                await call
        with pytest.raises(ValueError, match="host:port"):
            await policy.check_decode("d1", "10.0.0.2")
        # A registration that lapses (Redis restarting) does not cut off a known peer.
        client = redis.from_url(url)
        await client.delete(PREFIX + "d1")
        await client.aclose()
        await policy.check_decode("d1", "10.0.0.2:7000")
    finally:
        await policy.close()
    # An unreachable registry: a peer never confirmed cannot be vouched for.
    dead = PeerPolicy(registry_url=f"redis://127.0.0.1:{free_port()}/0")
    try:
        with pytest.raises(Unavailable, match="unreachable"):
            await dead.check_decode("d1", "10.0.0.2:7000")
    finally:
        await dead.close()
    assert PeerPolicy().open
    await PeerPolicy().check_decode("x", "192.0.2.1:9")  # no list: allowed (logged at start)


# ---- binding and settings -----------------------------------------------------------


def _listeners(port: int) -> list[str]:
    """Local addresses of the LISTEN sockets on ``port`` (/proc/net/tcp{,6})."""
    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(name).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            host, hexport = local.rsplit(":", 1)
            if int(hexport, 16) == port and state == "0A":
                out.append(host)
    return out


def test_torch_store_listens_on_its_host_only():
    import datetime

    store = listening_store("127.0.0.1", datetime.timedelta(seconds=5))
    assert _listeners(store.port) == ["0100007F"]  # 127.0.0.1, and nothing else
    del store


def test_bad_tls_settings_are_refused(certs):
    with pytest.raises(ValueError, match="does not match"):
        TLSConfig(str(certs / "decode.pem"), str(certs / "prefill-key.pem"))
    with pytest.raises(ValueError, match="no such file"):
        TLSConfig(str(certs / "decode.pem"), str(certs / "missing-key.pem"))
    with pytest.raises(ValueError, match="both"):
        TLSConfig(str(certs / "decode.pem"))
    with pytest.raises(ValueError, match="own --tls-cert-file"):
        TLSConfig(ca_file=str(certs / "ca.pem"))
    with pytest.raises(ValueError, match="no PEM certificate"):
        TLSConfig(str(certs / "decode.pem"), str(certs / "decode-key.pem"),
                  str(certs / "decode-key.pem"))
    # A process with a bad setting stops at once with the reason.
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "--transport", "torch", *tls_flags(certs, "gateway")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.returncode != 0
    assert "torch transport is neither encrypted nor authenticated" in result.stderr
