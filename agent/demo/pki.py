"""Throwaway TLS for the demo's and the tests' services: a CA that issues server and client
certificates (python3-cryptography), valid for two days."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class TlsFiles:
    """A CA and one server certificate (valid for 127.0.0.1, 127.0.0.2 and localhost)."""
    ca: str
    cert: str
    key: str


class ThrowawayCA:
    """A throwaway CA in ``directory`` (python3-cryptography) that issues certificates:
    servers' (with their names) and clients' (a client certificate's CN is its identity)."""

    def __init__(self, directory: str, name: str = "millwright test CA"):
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        os.makedirs(directory, exist_ok=True)
        self.now = datetime.datetime.now(datetime.timezone.utc)
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (x509.CertificateBuilder().subject_name(self.name).issuer_name(self.name)
                .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(self.now - datetime.timedelta(minutes=5))
                .not_valid_after(self.now + datetime.timedelta(days=2))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        self.path = os.path.join(directory, "ca.pem")
        with open(self.path, "wb") as fh:
            fh.write(cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cn: str, cert_path: str, key_path: str, hosts: tuple[str, ...] = ()) -> None:
        """A certificate for ``cn`` (valid for the IP addresses and DNS names ``hosts``),
        its key owner-only."""
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
             .issuer_name(self.name).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(self.now - datetime.timedelta(minutes=5))
             .not_valid_after(self.now + datetime.timedelta(days=2)))
        if hosts:
            names: list[x509.GeneralName] = []
            for h in hosts:
                try:
                    names.append(x509.IPAddress(ipaddress.ip_address(h)))
                except ValueError:
                    names.append(x509.DNSName(h))
            b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
        with open(cert_path, "wb") as fh:
            fh.write(b.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))


def make_pki(directory: str) -> TlsFiles:
    """A throwaway CA and server certificate in ``directory``."""
    ca = ThrowawayCA(directory)
    files = TlsFiles(ca.path, os.path.join(directory, "server.pem"), os.path.join(directory, "server.key"))
    ca.issue("localhost", files.cert, files.key, hosts=("localhost", "127.0.0.1", "127.0.0.2"))
    return files
