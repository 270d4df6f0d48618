"""The gateway's flags are made from GatewayConfig: same defaults, one flag
per field, and the flag names that deployments already use."""

from __future__ import annotations

import dataclasses

import pytest

from gateway.__main__ import parse
from gateway.config import GatewayConfig, cli_fields, flag_of, from_args

# Flags scripts and compose files already pass: renaming one breaks them.
KNOWN_FLAGS = {
    "--model", "--served-model-name", "--prefill", "--decode", "--state-url", "--api-key",
    "--api-key-file",
    "--transport", "--disagg-policy", "--disagg-min-remote-tokens", "--max-model-len", "--max-active-requests", "--lease-ms",
    "--max-attempts", "--stall-timeout-s", "--finished-ttl", "--grace",
    # Request limits.
    "--max-body-bytes", "--max-n", "--max-prompts", "--max-messages", "--max-tools", "--max-stop",
    "--max-stop-chars", "--max-bad-words", "--max-logit-bias", "--tokenizer-threads",
    # TLS (the --tls-* flags shared with workers are rpc/tls.py's, not fields here).
    "--tls-client-ca-file",
    # Browsers (CORS).
    "--allowed-origins",
    # Tool calling.
    "--tool-call-parser",
    # Sampling defaults from the model's generation_config.json.
    "--generation-config",
}


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for f in cli_fields():
        if f.metadata.get("env"):
            monkeypatch.delenv(f.metadata["env"], raising=False)


def test_no_flags_give_the_dataclass_defaults():
    assert from_args(parse([])) == GatewayConfig()


def test_every_field_has_its_flag():
    fields = {f.name for f in dataclasses.fields(GatewayConfig)}
    skipped = {f.name for f in dataclasses.fields(GatewayConfig)} - {f.name for f in cli_fields()}
    assert skipped == {"extra", "tls"}, "a new GatewayConfig field needs a flag (or cli=False)"
    assert {flag_of(f) for f in cli_fields()} == KNOWN_FLAGS
    assert fields - skipped == {f.name for f in cli_fields()}


def test_flags_reach_the_config():
    config = from_args(parse([
        "--prefill", "a:1", "--prefill", "b:2", "--decode", "c:3", "--lease-ms", "1234",
        "--grace", "2.5", "--finished-ttl", "7", "--transport", "torch",
        "--max-model-len", "99", "--max-attempts", "5",
    ]))
    assert (config.prefill, config.decode) == (("a:1", "b:2"), ("c:3",))
    assert (config.lease_ms, config.drain_grace_s, config.finished_ttl_s) == (1234, 2.5, 7)
    assert (config.transport, config.max_model_len, config.max_attempts) == ("torch", 99, 5)


def test_environment_defaults(monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://x:1/0")
    monkeypatch.setenv("TANDEM_API_KEY", "k")
    config = from_args(parse([]))
    assert (config.state_url, config.api_key) == ("redis://x:1/0", "k")
    assert from_args(parse(["--api-key", "other"])).api_key == "other"


def test_invalid_values_are_refused():
    with pytest.raises(SystemExit):
        parse(["--transport", "carrier-pigeon"])
    with pytest.raises(ValueError, match="max_active_requests"):
        from_args(parse(["--max-active-requests", "0"]))
