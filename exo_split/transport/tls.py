"""Node-to-node TLS: a certificate each node makes at its first start, pinned by the token.

There is no CA. A node's identity is a self-signed certificate (ECDSA P-256) kept with its key
in one file beside the token (mode 0600). A client of a node does not verify the certificate
against anything; instead the node's `GET /v1/hello` proof, an HMAC keyed by the shared token
(transport/auth.py), covers the SHA-256 fingerprint of the certificate it serves, and every
later request and the KV data connection are pinned to that fingerprint. A relay that
terminates TLS with a certificate of its own cannot make the proof for its certificate, and
cannot present the node's certificate: it is refused before anything but a nonce was sent.

Both planes share the node's one port: `datalink.Sniffer` tells a TLS ClientHello (HTTP over
TLS, handed to asyncio's TLS and then aiohttp), a `DATA_TLS_MAGIC` data connection and
cleartext apart. A data connection's TLS runs on blocking sockets, off the event loop: its
handshake on a thread, then the prefill node's send thread encrypts straight from the KV and
the decode node's receive thread decrypts straight into its cache (transport/stream.py).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import os
import ssl
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from exo_split.errors import ExoSplitError

DATA_TLS_MAGIC = b"EXOT"  # a KV data connection whose TLS handshake follows these 4 bytes
TLS_RECORD = 0x16  # the first byte of a TLS handshake record: HTTP over TLS


@dataclass(frozen=True)
class Identity:
    """A node's certificate: `path` holds key and certificate (PEM), `cert_path` the
    certificate alone (what an API client may trust), `fingerprint` its SHA-256 (hex)."""

    path: Path
    cert_path: Path
    fingerprint: str
    context: ssl.SSLContext = field(repr=False, compare=False)


def load_identity(directory: Path) -> tuple[Identity, bool]:
    """The node identity in `directory` (made there if there is none): (identity, made)."""
    path = directory / "node-tls.pem"
    made = False
    if not path.is_file():
        made = _make(path)
    try:
        pem = path.read_bytes()
        context = server_context(path)
    except (OSError, ssl.SSLError) as exc:
        raise ExoSplitError(
            f"cannot use the node certificate {path}: {exc}",
            hint="delete it and restart the node: a new one is made (peers need nothing new)",
        ) from exc
    cert_pem = pem[pem.index(b"-----BEGIN CERTIFICATE-----") :]
    der = ssl.PEM_cert_to_DER_cert(cert_pem.decode())
    cert_path = directory / "node-cert.pem"
    if not cert_path.is_file() or cert_path.read_bytes() != cert_pem:
        _write_atomic(cert_path, cert_pem, 0o644)
    return Identity(path, cert_path, hashlib.sha256(der).hexdigest(), context), made


def _make(path: Path) -> bool:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "exo-split node")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ) + cert.public_bytes(serialization.Encoding.PEM)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return _write_atomic(path, pem, 0o600, replace=False)


def _write_atomic(path: Path, data: bytes, mode: int, *, replace: bool = True) -> bool:
    """Write via a temporary file; `replace=False`: keep a file another process made first
    (False is returned then)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def server_context(path: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(path)
    ctx.num_tickets = 0  # no session tickets: after the handshake a data connection is ours
    return ctx


@functools.cache
def client_context() -> ssl.SSLContext:
    """TLS to a node: its certificate is checked by fingerprint (`check_pin`), not by a CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def fingerprint_of(ssl_object) -> str:
    """The SHA-256 (hex) of the certificate the other end presented."""
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    return hashlib.sha256(der).hexdigest() if der else ""


def is_fingerprint(value: object) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def secure_url(url: str, secure: bool) -> str:
    """A peer's URL for node-to-node traffic: https unless the node runs without TLS."""
    if secure and url.startswith("http://"):
        return "https://" + url.removeprefix("http://")
    return url
