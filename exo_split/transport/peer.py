"""Talking to a peer node: it proves it holds the token before anything is sent to it, and
over https every request is pinned to the certificate its proof covers (transport/auth.py,
transport/tls.py). Failures are named after the peer (PeerUnavailable, UntrustedPeer).
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

import aiohttp

from exo_split.errors import ExoSplitError, PeerUnavailable, UntrustedPeer
from exo_split.transport.auth import is_nonce, new_nonce, proof_header, server_proof
from exo_split.transport.tls import client_context, is_fingerprint


async def peer_headers(
    session: aiohttp.ClientSession, base_url: str, token: str | None, method: str,
    target: str, body: bytes = b"", *, timeout: float = 5.0,
) -> dict[str, Any]:  # fmt: skip
    """The request arguments (`headers`, `ssl`) of one request to a peer, once the peer has
    proven that it holds the token (GET /v1/hello, transport/auth.py); the token itself
    never travels. Over https the request is pinned to the certificate the proof covers
    (transport/tls.py). A peer that cannot prove it (a stranger advertising itself on the
    LAN, an older exo-split) is UntrustedPeer, and nothing else was sent to it."""
    secure = base_url.startswith("https://")
    if not token:
        return {"headers": {}, "ssl": client_context()} if secure else {"headers": {}}
    what = f"{method} {target.partition('?')[0]}"  # what a failure to connect is named after
    nc, ns, cert = await prove_peer(session, base_url, token, timeout=timeout, what=what)
    headers = {"Authorization": proof_header(token, nc, ns, method, target, body)}
    if not secure:
        return {"headers": headers}
    return {"headers": headers, "ssl": aiohttp.Fingerprint(bytes.fromhex(cert))}


async def prove_peer(
    session: aiohttp.ClientSession, base_url: str, token: str, *, timeout: float = 5.0,
    what: str = "GET /v1/hello",
) -> tuple[str, str, str]:  # fmt: skip
    """(our nonce, the peer's, its certificate's fingerprint: "" in cleartext) once the peer
    has proven it holds `token`; UntrustedPeer otherwise (see `peer_headers`)."""
    nc = new_nonce()
    secure = base_url.startswith("https://")
    extra = {"ssl": client_context()} if secure else {}
    with client_errors(base_url, what):
        async with session.get(
            f"{base_url}/v1/hello?nonce={nc}", timeout=aiohttp.ClientTimeout(total=timeout),
            **extra,
        ) as resp:  # fmt: skip
            answer = await resp.json(content_type=None) if resp.status == 200 else None
    ns = answer.get("nonce") if isinstance(answer, dict) else None
    proof = answer.get("proof") if isinstance(answer, dict) else None
    cert = answer.get("cert", "") if isinstance(answer, dict) else ""
    if not (is_nonce(ns) and isinstance(proof, str)
            and (is_fingerprint(cert) if secure else cert == "")
            and hmac.compare_digest(proof, server_proof(token, nc, ns, cert))):  # fmt: skip
        raise UntrustedPeer(
            f"{base_url} did not prove that it holds the shared token (GET /v1/hello): "
            "nothing was sent to it",
            hint="a device that only advertises itself, or a node with another token or an "
            "older exo-split",
        )
    return nc, ns, cert


def client_errors(peer: str, what: str):
    """Map transport exceptions to PeerUnavailable with the peer's name."""

    class _Ctx:
        def __enter__(self):
            return self

        def __exit__(self, et, exc, tb):
            if exc is None or isinstance(exc, ExoSplitError):
                return False
            if isinstance(exc, asyncio.TimeoutError | TimeoutError):
                raise PeerUnavailable(f"{peer}: {what} timed out") from exc
            if isinstance(exc, aiohttp.ServerFingerprintMismatch):
                raise UntrustedPeer(
                    f"{peer}: {what}: the TLS certificate is not the one its proof covered",
                    hint="something between the nodes answers for the peer",
                ) from exc
            if isinstance(exc, aiohttp.ClientError | OSError | EOFError):
                raise PeerUnavailable(
                    f"{peer}: {what} failed: {exc or type(exc).__name__}"
                ) from exc
            return False

    return _Ctx()
