"""Which KV transports a worker runs, and the fallback when one cannot.

``--transport`` is an ordered list (``mooncake,grpc``): each is started in
turn; one that cannot start (its library is missing, its protocol has no
NIC, TLS forbids it) is skipped with a warning and counted in
``tandem:kv_transport_fallbacks``, and the next one stands in. The first
that started is a prefill worker's default. ``grpc`` always starts, and
``torch`` needs nothing at start (its groups open on first use).

Per request, a prefill worker asked for a transport it or the ticket's
decode worker does not run falls back the same way (``fallback``): logged
once per cause, counted every time, never silent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kv_transfer.mooncake_endpoint import PROTOCOLS, MooncakeEndpoint, TransportUnavailable

logger = logging.getLogger("worker")

TRANSPORTS = ("grpc", "torch", "mooncake")
# Transports whose traffic is neither encrypted nor authenticated.
PLAINTEXT = ("torch", "mooncake")


@dataclass(frozen=True)
class TransportConfig:
    order: tuple[str, ...] = ("grpc",)
    host: str = "127.0.0.1"  # where peers reach this worker's transfer engine
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""  # RDMA NIC name(s) for protocol rdma, e.g. "mlx5_0"
    # A prefill worker sends each layer's KV (mooncake, torch) while later
    # layers compute: "on", "off", or "auto" (on when the KV cache is on a GPU).
    kv_layer_writes: str = "auto"
    # Where the mooncake engine's threads run (--mooncake-cores;
    # kv_transfer/mooncake_endpoint.py). Empty: wherever the worker may run.
    mooncake_cores: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.order:
            raise ValueError("--transport needs at least one transport")
        for name in self.order:
            if name not in TRANSPORTS:
                raise ValueError(f"unknown transport {name!r}; choose from {TRANSPORTS}")
        if len(set(self.order)) != len(self.order):
            raise ValueError(f"--transport names a transport twice: {','.join(self.order)}")
        if self.kv_layer_writes not in ("auto", "on", "off"):
            raise ValueError(f"--kv-layer-writes must be auto, on or off, "
                             f"got {self.kv_layer_writes!r}")
        if self.mooncake_protocol not in PROTOCOLS:
            raise ValueError(f"--mooncake-protocol must be one of {PROTOCOLS}, "
                             f"got {self.mooncake_protocol!r}")
        if self.mooncake_cores and "mooncake" not in self.order:
            raise ValueError("--mooncake-cores needs mooncake in --transport")

    @classmethod
    def parse(cls, spec: str, **kw) -> TransportConfig:
        return cls(tuple(t.strip() for t in spec.split(",") if t.strip()), **kw)


class Transports:
    """The transports one worker started (``started``, in preference order)
    and its mooncake endpoint, if that one started."""

    def __init__(self, config: TransportConfig, io, plaintext_allowed: bool, metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.started: list[str] = []
        self.mooncake: MooncakeEndpoint | None = None
        self._logged: set[tuple[str, str, str]] = set()
        for i, name in enumerate(config.order):
            try:
                if name in PLAINTEXT and not plaintext_allowed:
                    raise TransportUnavailable("it is neither encrypted nor authenticated and "
                                               "TLS is on (--tls-allow-torch-transport allows "
                                               "it on a trusted network)")
                if name == "mooncake":
                    self.mooncake = MooncakeEndpoint(io, config.host, config.mooncake_protocol,
                                                     config.mooncake_device,
                                                     config.mooncake_cores)
            except TransportUnavailable as exc:
                rest = [t for t in config.order[i + 1:]]
                if not rest:
                    raise TransportUnavailable(f"KV transport {name} cannot start ({exc}) and "
                                               "--transport names none after it") from None
                logger.warning("KV transport %s cannot start (%s): falling back to %s", name,
                               exc, rest[0])
                metrics.transport_fallbacks.labels(name, rest[0], "start").inc()
                continue
            self.started.append(name)

    @property
    def default(self) -> str:
        return self.started[0]

    def layer_writes(self, device) -> bool:
        """Whether mooncake and torch send by layer for a KV cache on ``device``."""
        mode = self.config.kv_layer_writes
        return mode == "on" or (mode == "auto" and device.type == "cuda")

    def fallback(self, wanted: str, reason: str, usable) -> str:
        """The transport standing in for ``wanted`` on one transfer: the first
        started one that ``usable(name)`` accepts (grpc always is)."""
        used = next((t for t in self.started if t != wanted and usable(t)), "grpc")
        key = (wanted, used, reason)
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("KV transport %s is not usable (%s): using %s (logged once; "
                           "counted in tandem:kv_transport_fallbacks)", wanted, reason, used)
        self.metrics.transport_fallbacks.labels(wanted, used, "request").inc()
        return used

    def close(self) -> None:
        if self.mooncake is not None:
            self.mooncake.close()
            self.mooncake = None
