"""Keys, certificates and CRLs of a provisioned fleet, with ``cryptography``; private files 0600.

TLS keys are EC P-256 (small, fast, supported by every OpenSSL a broker or a Jetson ships).
Certificates carry what OpenSSL checks in a mutual-TLS handshake: basic constraints, key
usage, extended key usage (client or server) and, for the broker, its names (SAN).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CA_DAYS",
    "crl",
    "issue",
    "make_ca",
    "pem_cert",
    "pem_private",
    "pem_public",
    "private_dir",
    "write_public",
    "write_secret",
]

CA_DAYS = 3650
# a CRL past its next update makes OpenSSL refuse *every* client: keep it valid as long as the CA
CRL_DAYS = CA_DAYS


# -- files ---------------------------------------------------------------------------------------


def write_secret(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 0600 before writing: the key is never readable by others."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_public(path: Path, data: bytes | str) -> None:
    """Write a file everyone may read (certificates, public keys, configs): mode 0644."""
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    path.chmod(0o644)


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) with mode 0700: kits and the CA hold private keys."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def pem_private(key: Any) -> bytes:
    """An unencrypted PKCS#8 PEM private key (its protection is the file mode)."""
    pem: bytes = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return pem


def pem_public(key: Any) -> bytes:
    """A SubjectPublicKeyInfo PEM public key."""
    pem: bytes = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return pem


def pem_cert(cert: x509.Certificate) -> bytes:
    """A PEM certificate."""
    return cert.public_bytes(serialization.Encoding.PEM)


# -- certificates ------------------------------------------------------------------------------


def _name(cn: str, federation: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"edgefl {federation}"),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


_USAGES = (
    "digital_signature",
    "content_commitment",
    "key_encipherment",
    "data_encipherment",
    "key_agreement",
    "key_cert_sign",
    "crl_sign",
    "encipher_only",
    "decipher_only",
)


def _key_usage(**granted: bool) -> x509.KeyUsage:
    """A KeyUsage extension with only ``granted`` set (the class wants all nine flags)."""
    return x509.KeyUsage(**{**dict.fromkeys(_USAGES, False), **granted})


def make_ca(federation: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA (10 years) that may sign leaf certificates and CRLs only."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(f"edgefl {federation} CA", federation)
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _san(hostnames: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hostnames:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    cn: str,
    federation: str,
    *,
    days: int,
    server_names: Sequence[str] = (),
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A leaf key and certificate: a client certificate, or a server one with ``server_names``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server_names else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn, federation))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)  # ECDHE handshakes
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if server_names:
        builder = builder.add_extension(_san(server_names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def crl(
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, serials: Sequence[str]
) -> x509.CertificateRevocationList:
    """The CRL of ``serials`` (hex), signed by the CA, valid as long as the CA."""
    now = _now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - dt.timedelta(minutes=5))
        .next_update(now + dt.timedelta(days=CRL_DAYS))
    )
    for serial in serials:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder()
            .serial_number(int(serial, 16))
            .revocation_date(now - dt.timedelta(minutes=5))
            .build()
        )
    return builder.sign(ca_key, hashes.SHA256())
