"""A local CA and the certificates a TLS cluster needs, for docker compose and
tests (not a production PKI).

    python scripts/gen_certs.py certs                                  # gateway, prefill, decode
    python scripts/gen_certs.py certs --name gateway --name worker --san tandem-internal

Writes into the directory: ``ca.pem`` (give it to every process as
``--tls-ca-file`` and to clients), ``ca-key.pem`` (keep it away from the
services), ``NAME.pem`` / ``NAME-key.pem`` for each ``--name`` (a server
certificate that is also a client certificate, for mTLS between services),
and ``client.pem`` / ``client-key.pem`` (a client certificate only, for a
caller of the gateway when ``--tls-client-ca-file`` asks for one).

Every server certificate names localhost, 127.0.0.1 and ::1, its own name,
and each ``--san`` (a DNS name or an IP address), e.g. a name all workers
share for ``--tls-server-name`` when their addresses are run-time IPs.
Keys are ECDSA P-256; private keys are written readable by the owner only.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_NAMES = ("gateway", "prefill", "decode")
LOCAL_SANS = ("localhost", "127.0.0.1", "::1")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Tandem local CA"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(value: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(value))
    except ValueError:
        return x509.DNSName(value)


def _builder(subject: str, issuer: x509.Name, key, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _write(directory: Path, stem: str, cert: x509.Certificate, key) -> None:
    (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = directory / f"{stem}-key.pem"
    key_bytes = key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_bytes)


def generate(directory: Path, names: list[str], sans: list[str], days: int = 365) -> list[Path]:
    """Write the CA, one certificate per name and the client certificate;
    returns the certificate files written."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("Tandem local CA")
    ca = (_builder("Tandem local CA", ca_name, ca_key, days)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    _write(directory, "ca", ca, ca_key)
    written = [directory / "ca.pem"]
    leaf_usage = x509.KeyUsage(digital_signature=True, key_agreement=True,
                               content_commitment=False, key_encipherment=False,
                               data_encipherment=False, key_cert_sign=False, crl_sign=False,
                               encipher_only=False, decipher_only=False)
    authority = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    for stem, usages, alt in (
        *((n, [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
           [*LOCAL_SANS, n, *sans]) for n in names),
        ("client", [ExtendedKeyUsageOID.CLIENT_AUTH], []),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (_builder(stem, ca_name, key, days)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(leaf_usage, critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                   .add_extension(authority, critical=False))
        if alt:
            unique = list(dict.fromkeys(alt))
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_san(v) for v in unique]), critical=False)
        _write(directory, stem, builder.sign(ca_key, hashes.SHA256()), key)
        written.append(directory / f"{stem}.pem")
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--name", action="append", default=[],
                   help="a service to make a certificate NAME.pem for (repeatable; default: "
                        + ", ".join(DEFAULT_NAMES) + ")")
    p.add_argument("--san", action="append", default=[],
                   help="another DNS name or IP address every service certificate names")
    p.add_argument("--days", type=int, default=365)
    p.add_argument("--force", action="store_true", help="replace an existing CA")
    args = p.parse_args(argv)
    if (args.directory / "ca.pem").exists() and not args.force:
        p.error(f"{args.directory / 'ca.pem'} exists; --force replaces it (and every "
                "certificate it signed)")
    if "client" in args.name:
        p.error("'client' is the client certificate's name; choose another")
    for path in generate(args.directory, args.name or list(DEFAULT_NAMES), args.san, args.days):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
