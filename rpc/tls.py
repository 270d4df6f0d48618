"""TLS settings shared by the gateway, the workers and the health check: the
flags, their validation, and the gRPC credentials made from the files.

One certificate and key per process serve both directions: a server shows
them to its callers, and the same pair is the client certificate when the
process calls another (mTLS). The CA file is what peers are checked against:
with it, a worker's gRPC server refuses callers without a certificate the
CA signed, and every outgoing channel checks the server's certificate.
"""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True)
class TLSConfig:
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    # The name peers' certificates are checked against instead of the host in
    # their address: for addresses that are IPs known only at run time
    # (docker compose advertises ``hostname -i``).
    server_name: str | None = None
    # The torch transport (gloo/NCCL) cannot encrypt or authenticate: under
    # TLS it is refused unless this says the network is trusted.
    allow_torch_transport: bool = False

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("TLS needs both --tls-cert-file and --tls-key-file (got only "
                             f"{'the certificate' if self.cert_file else 'the key'})")
        if self.ca_file and not self.cert_file:
            raise ValueError("--tls-ca-file turns on mTLS, which needs this process's own "
                             "--tls-cert-file and --tls-key-file")
        for flag, path in (("--tls-cert-file", self.cert_file), ("--tls-key-file", self.key_file),
                           ("--tls-ca-file", self.ca_file)):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag}: no such file {path!r}")
        if self.enabled:
            check_files(self.cert_file, self.key_file, self.ca_file)

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    @property
    def mutual(self) -> bool:
        """Peers must show a certificate the CA signed (and are checked)."""
        return bool(self.ca_file)

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        return Path(self.cert_file).read_bytes(), Path(self.key_file).read_bytes(), ca

    def server_credentials(self, client_ca_file: str | None) -> grpc.ServerCredentials:
        """Serve with this certificate; with ``client_ca_file``, refuse callers
        without a certificate it signed (workers pass ``ca_file``: mTLS)."""
        cert, key, _ = self._read()
        ca = Path(client_ca_file).read_bytes() if client_ca_file else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Checks the server against the CA and shows this process's certificate."""
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        if self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []


def check_files(cert_file: str, key_file: str, ca_file: str | None) -> None:
    """ValueError unless the key belongs to the certificate and the CA file
    holds certificates: found now, at start, rather than at the first call."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise ValueError(f"--tls-key-file {key_file!r} does not match --tls-cert-file "
                         f"{cert_file!r}, or one is not PEM ({exc.reason or exc})") from None
    if ca_file:
        try:
            ctx.load_verify_locations(cafile=ca_file)
        except ssl.SSLError as exc:
            raise ValueError(f"--tls-ca-file {ca_file!r} holds no PEM certificate "
                             f"({exc.reason or exc})") from None


# ---- flags ----------------------------------------------------------------------------

_HELP = {
    "cert_file": "PEM certificate this process serves TLS with (and shows as its client "
                 "certificate to peers)",
    "key_file": "PEM private key of --tls-cert-file",
    "ca_file": "PEM CA that peers' certificates must be signed by: turns on mTLS between "
               "the gateway and workers and between workers",
    "server_name": "name peer certificates are checked against instead of the host in their "
                   "address (for run-time IP addresses)",
    "allow_torch_transport": "allow the torch and mooncake KV transports under TLS although "
                             "they are neither encrypted nor authenticated (a trusted network "
                             "only)",
}


def env_of(name: str) -> str:
    return "TANDEM_TLS_" + name.upper()


def flag_of(name: str) -> str:
    return "--tls-" + name.replace("_", "-")


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-*`` flags, one per ``TLSConfig`` field; each defaults to its
    ``TANDEM_TLS_*`` environment variable (so compose files and the health
    check share one setting)."""
    g = parser.add_argument_group("TLS")
    for f in fields(TLSConfig):
        env = os.environ.get(env_of(f.name))
        if f.type == "bool" or isinstance(f.default, bool):
            default = env.lower() in ("1", "true", "yes") if env else f.default
            g.add_argument(flag_of(f.name), dest="tls_" + f.name, action="store_true",
                           default=default, help=f"{_HELP[f.name]} (${env_of(f.name)})")
        else:
            g.add_argument(flag_of(f.name), dest="tls_" + f.name, default=env or f.default,
                           metavar="PATH" if f.name.endswith("_file") else "NAME",
                           help=f"{_HELP[f.name]} (${env_of(f.name)})")


def tls_from_args(args: argparse.Namespace) -> TLSConfig:
    return TLSConfig(**{f.name: getattr(args, "tls_" + f.name) for f in fields(TLSConfig)})
