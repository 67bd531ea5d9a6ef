"""A throwaway PKI for the TLS tests: CAs and the certificates they issue, written as PEM files
(P-256 keys: quick to make)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path, password: bytes | None = None) -> None:
    encryption: serialization.KeySerializationEncryption = (
        serialization.NoEncryption()
        if password is None
        else serialization.BestAvailableEncryption(password)
    )
    pkcs8 = serialization.PrivateFormat.PKCS8
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, pkcs8, encryption))


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


class CA:
    """A self-signed CA in ``directory`` (``<name>-ca.pem``) that issues leaf certificates."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"{name} CA"))
            .issuer_name(_name(f"{name} CA"))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
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
            .sign(self._key, hashes.SHA256())
        )
        self.cert = directory / f"{name}-ca.pem"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        name: str,
        *,
        hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
        key_password: bytes | None = None,
    ) -> Issued:
        """A leaf for ``hosts`` (DNS names or IPs), good for server and client auth."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = []
        for host in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        issued = Issued(
            cert=self.directory / f"{self.name}-{name}.pem",
            key=self.directory / f"{self.name}-{name}.key",
        )
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, issued.key, key_password)
        return issued


@dataclass(frozen=True)
class PKI:
    ca: CA
    other_ca: CA  # trusted by nobody in the tests
    server: Issued  # from ca, for localhost and 127.0.0.1
    client: Issued  # from ca
    foreign_client: Issued  # from other_ca
    foreign_server: Issued  # from other_ca, for localhost and 127.0.0.1
    named: Issued  # from ca, for the name "target" only


def make_pki(root: Path) -> PKI:
    ca, other = CA("tandem", root), CA("other", root)
    return PKI(
        ca=ca,
        other_ca=other,
        server=ca.issue("server"),
        client=ca.issue("client"),
        foreign_client=other.issue("client"),
        foreign_server=other.issue("server"),
        named=ca.issue("target", hosts=("target",)),
    )
