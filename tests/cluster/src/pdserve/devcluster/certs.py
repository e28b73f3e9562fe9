"""Certificates and keys of the local control plane: one CA, the API server's serving
certificate, a client certificate per component and the service-account signing key."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Names a client inside the cluster may use for the API server (the `kubernetes`
# Service), plus loopback, where every component of this cluster connects.
SERVING_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
SERVING_IPS = ("127.0.0.1", "10.0.0.1")
# The certificates only live as long as a test session or a `make cluster` run.
VALIDITY = datetime.timedelta(days=7)


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its PEM private key, as files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class ClusterPKI:
    """Every file the control plane needs for TLS and service-account tokens."""

    ca: KeyPair
    serving: KeyPair
    clients: dict[str, KeyPair]
    service_account_key: Path
    service_account_pub: Path


def _new_key() -> ec.EllipticCurvePrivateKey:
    # ECDSA P-256: generated in milliseconds, accepted by every Kubernetes component.
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _builder(
    subject: x509.Name, issuer: x509.Name, public: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        # Backdated a little: a freshly started server must not see a future notBefore.
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


def _write_pair(
    directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> KeyPair:
    pair = KeyPair(cert=directory / f"{name}.crt", key=directory / f"{name}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(pair.key, key)
    return pair


class _Authority:
    """A self-signed CA that issues the cluster's leaf certificates."""

    def __init__(self) -> None:
        self.key = _new_key()
        self.name = _name("pdserve-devcluster-ca")
        self.cert = (
            _builder(self.name, self.name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )

    def issue(
        self,
        subject: x509.Name,
        usage: x509.ObjectIdentifier,
        sans: list[x509.GeneralName] | None = None,
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        """A leaf certificate for `subject`, for server or client authentication."""
        key = _new_key()
        builder = (
            _builder(subject, self.name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(self.key, hashes.SHA256()), key


def _serving_sans(extra_ips: tuple[str, ...]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in SERVING_DNS_NAMES]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in (*SERVING_IPS, *extra_ips)]
    return names


def make_pki(
    directory: Path, clients: dict[str, str], serving_ips: tuple[str, ...] = ()
) -> ClusterPKI:
    """Write a CA, a serving certificate and client certificates into `directory`.

    `clients` maps a file name to the user name (certificate CN) of each client;
    `serving_ips` are more addresses the API server's certificate names. Every client
    is in the `system:masters` group: this cluster is a private test fixture,
    and full rights keep each component independent of RBAC bootstrap ordering.
    """
    directory.mkdir(parents=True, exist_ok=True)
    authority = _Authority()
    ca = _write_pair(directory, "ca", authority.cert, authority.key)
    serving = _write_pair(
        directory,
        "serving",
        *authority.issue(
            _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, _serving_sans(serving_ips)
        ),
    )
    pairs = {
        file_name: _write_pair(
            directory,
            file_name,
            *authority.issue(_name(user, "system:masters"), ExtendedKeyUsageOID.CLIENT_AUTH),
        )
        for file_name, user in clients.items()
    }
    sa_key = _new_key()
    _write_key(directory / "service-account.key", sa_key)
    sa_pub = directory / "service-account.pub"
    sa_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return ClusterPKI(ca, serving, pairs, directory / "service-account.key", sa_pub)
