"""The gateway's settings, and the command-line flags made from them.

``GatewayConfig``'s fields are the only source of each default: every
field has a flag (named in its metadata when the name is not the field's
own), typed from its annotation, so the two cannot drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from engine.generation_config import CHOICES as GENERATION_CONFIGS
from engine.generation_config import check_choice as check_generation_config
from gateway.disagg_policy import POLICIES
from gateway.tool_parsers import PARSERS
from rpc.lease import DEFAULT_LEASE_MS
from rpc.tls import TLSConfig, add_tls_arguments, tls_from_args

TRANSPORTS = ("grpc", "torch", "mooncake")


def _opt(default: Any, help: str = "", flag: str | None = None, env: str | None = None,
         choices: tuple[str, ...] | None = None, cli: bool = True) -> Any:
    """A field with its flag's settings: ``flag`` when not ``--field-name``,
    ``env`` the environment variable that overrides the default."""
    meta = {"help": help, "flag": flag, "env": env, "choices": choices, "cli": cli}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class GatewayConfig:
    model: str | None = _opt(None, "the model the workers serve (for the tokenizer); "
                                   "default SmolLM2")
    served_model_name: str | None = _opt(None)
    prefill: tuple[str, ...] = _opt((), "prefill worker address")
    decode: tuple[str, ...] = _opt((), "decode (or 'both') worker address")
    state_url: str | None = _opt(None, "Redis URL for request state and worker registration "
                                       "(default $REDIS_URL; none: in-process)", env="REDIS_URL")
    api_key: str | None = _opt(None, "API key callers must send (Authorization: Bearer); "
                                     "several separated by commas", env="TANDEM_API_KEY")
    api_key_file: str | None = _opt(None, "file of API keys, one a line, read again when it "
                                          "changes (rotation without a restart)",
                                    env="TANDEM_API_KEY_FILE")
    transport: str = _opt("grpc", choices=TRANSPORTS)
    disagg_policy: str = _opt("always", "where prompts are computed: always on a prefill worker "
                                        "(then the KV moves), never (on the decode worker), or "
                                        "auto (per request, a cost model: "
                                        "gateway/disagg_policy.py)", choices=POLICIES)
    disagg_min_remote_tokens: int = _opt(256, "under --disagg-policy auto, prompts with at most "
                                              "this many tokens not cached on the decode worker "
                                              "are computed there")
    max_model_len: int | None = _opt(None)
    generation_config: str = _opt("auto", "auto: the sampling defaults in the model's "
                                          "generation_config.json fill the fields a request "
                                          "leaves unset (vLLM's default); vllm: ignore them",
                                  choices=GENERATION_CONFIGS)
    max_active_requests: int = _opt(256)
    lease_ms: int = _opt(DEFAULT_LEASE_MS, "how long a decode worker holds blocks reserved for a "
                                 "prompt (plus 25 ms per prompt token)")
    max_attempts: int = _opt(3, "attempts per completion before it fails")
    stall_timeout_s: float = _opt(5.0, "a decode stream with no token for this long (or 20 of "
                                       "its worker's steps, if longer) while its worker runs "
                                       "no step moves to another worker")
    finished_ttl_s: int = _opt(3600, "seconds finished request records are kept",
                               flag="--finished-ttl")
    drain_grace_s: float = _opt(10.0, flag="--grace")
    # Limits, checked before any work is done or anything allocated for a
    # request (docs/reliability.md): a request over one gets a 4xx.
    max_body_bytes: int = _opt(8 << 20, "largest REST request body (413 above) or gRPC "
                                         "request message (RESOURCE_EXHAUSTED above)")
    max_n: int = _opt(16, "most completions one request may ask for (n)")
    max_prompts: int = _opt(64, "most prompts in one /v1/completions request")
    max_messages: int = _opt(1024, "most messages in one chat request")
    max_tools: int = _opt(128, "most tools in one chat request (OpenAI's limit)")
    max_stop: int = _opt(16, "most stop strings plus stop token ids in one request")
    max_stop_chars: int = _opt(1024, "longest stop string or bad word, in characters")
    max_bad_words: int = _opt(64, "most bad_words in one request (each tokenized by the workers)")
    max_logit_bias: int = _opt(1024, "most logit_bias entries in one request")
    tokenizer_threads: int = _opt(2, "threads that tokenize off the event loop")
    # TLS: the shared --tls-* flags (rpc/tls.py) serve the REST and gRPC
    # ports and make the calls to workers mTLS.
    tls: TLSConfig = field(default_factory=TLSConfig, metadata={"cli": False})
    tls_client_ca_file: str | None = _opt(
        None, "CA that REST and gRPC callers' certificates must be signed by (then "
              "required); default none: API keys authenticate callers",
        env="TANDEM_TLS_CLIENT_CA_FILE")
    allowed_origins: str = _opt("*", "origins a browser may call the REST API from (CORS), "
                                     "separated by commas; '' for none")
    tool_call_parser: str = _opt("hermes", "how tool calls are found in the model's text under "
                                           "tool_choice 'auto'", choices=PARSERS)
    extra: dict = _opt({}, cli=False)

    def __post_init__(self) -> None:
        check_generation_config(self.generation_config)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.disagg_policy not in POLICIES:
            raise ValueError(f"disagg_policy must be one of {POLICIES}, "
                             f"got {self.disagg_policy!r}")
        if self.disagg_min_remote_tokens < 0:
            raise ValueError("disagg_min_remote_tokens must be >= 0, "
                             f"got {self.disagg_min_remote_tokens}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be positive, got {self.stall_timeout_s}")
        if self.transport in ("torch", "mooncake") and self.tls.enabled \
                and not self.tls.allow_torch_transport:
            raise ValueError(f"the {self.transport} transport is neither encrypted nor "
                             "authenticated: under "
                             "TLS use --transport grpc, or --tls-allow-torch-transport on a "
                             "trusted network")
        if self.tls_client_ca_file:
            if not self.tls.enabled:
                raise ValueError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
            if not os.path.isfile(self.tls_client_ca_file):
                raise ValueError(f"--tls-client-ca-file: no such file "
                                 f"{self.tls_client_ca_file!r}")
        if self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {PARSERS}, "
                             f"got {self.tool_call_parser!r}")
        for name in ("max_active_requests", "max_body_bytes", "max_n", "max_prompts",
                     "max_messages", "max_tools", "max_stop", "max_stop_chars", "max_bad_words",
                     "max_logit_bias", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def cli_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(GatewayConfig) if f.metadata.get("cli", True)]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field of ``GatewayConfig``, and the shared ``--tls-*`` ones."""
    hints = typing.get_type_hints(GatewayConfig)
    for f in cli_fields():
        kind = hints[f.name]
        kw: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help") or None}
        if typing.get_origin(kind) is tuple:  # repeated: --prefill A --prefill B
            kw.update(action="append", type=typing.get_args(kind)[0], default=[])
        else:
            if isinstance(kind, types.UnionType):  # X | None
                kind = next(a for a in typing.get_args(kind) if a is not type(None))
            env = f.metadata.get("env")
            default = os.environ.get(env, f.default) if env else f.default
            kw.update(type=kind, default=default)
            if f.metadata.get("choices"):
                kw["choices"] = list(f.metadata["choices"])
        parser.add_argument(flag_of(f), **kw)
    add_tls_arguments(parser)


def from_args(args: argparse.Namespace) -> GatewayConfig:
    values = {}
    for f in cli_fields():
        value = getattr(args, f.name)
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return GatewayConfig(**values, tls=tls_from_args(args))
