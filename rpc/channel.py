"""Channel and server options: message size limits are explicit everywhere."""

from __future__ import annotations

import grpc

from rpc.tls import TLSConfig

# KV chunks are a few MiB; leave headroom over the 4 MiB default.
MAX_MESSAGE_BYTES = 64 << 20

OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # Server side: accept the clients' keepalive pings above, and the pings
    # grpc sends after cancelling a call. With the defaults (one ping per 5
    # minutes, 2 strikes) a few cancelled calls in a row get the connection
    # closed with GOAWAY "too_many_pings", failing every call on it.
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def aio_channel(address: str, tls: TLSConfig | None = None) -> grpc.aio.Channel:
    """A channel to ``address``: mTLS (the server checked against the CA, this
    process's certificate shown) when ``tls`` has a CA, plaintext otherwise (a
    gateway may serve TLS to its callers and talk plaintext to local workers)."""
    if tls is None or not tls.mutual:
        return grpc.aio.insecure_channel(address, options=OPTIONS)
    return grpc.aio.secure_channel(address, tls.channel_credentials(),
                                   options=[*OPTIONS, *tls.channel_options()])
