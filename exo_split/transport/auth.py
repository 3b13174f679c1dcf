"""The shared token that both node agents and the client present (DESIGN §4).

Never logged, never advertised, never echoed in an error, compared in constant time. A node
started without one generates it, stores it with mode 0600 under the user's config directory
and says how to copy it to the other machine.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from pathlib import Path

from exo_split.errors import ExoSplitError

log = logging.getLogger(__name__)
ENV_VAR = "EXO_SPLIT_TOKEN"


def default_token_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "exo-split" / "token"


def read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ExoSplitError(f"cannot read the token file {path}: {why}") from exc
    if not token:
        raise ExoSplitError(f"the token file {path} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the token file %s is readable by other users; run: chmod 600 %s", path, path)
    return token


def resolve_token(
    token_file: Path | None, environ: dict[str, str], *, create: bool
) -> tuple[str, str]:
    """(token, where it came from). `create`: generate and store one when none is found."""
    if environ.get(ENV_VAR, "").strip():  # set but empty counts as not set
        return environ[ENV_VAR].strip(), f"${ENV_VAR}"
    path = token_file or default_token_file()
    if path.is_file():
        return read_token(path), str(path)
    if token_file is not None or not create:
        raise ExoSplitError(
            f"no token: {path} does not exist and ${ENV_VAR} is not set",
            hint="copy the token file from the machine whose node generated it "
            "(shown at its start-up) or set EXO_SPLIT_TOKEN",
        )
    return _generate(path), f"{path} (new)"


def _generate(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another node on this machine generated it first
        return read_token(path)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # whatever the umask
        f.write(token + "\n")
    return token


def copy_instructions(path: Path) -> str:
    """How to give the other machine this token: its path and commands, never the token."""
    try:
        shown = "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        shown = str(path)
    return (
        f"generated a new token in {path} (mode 0600). The other machine needs the same token:\n"
        f"  scp {path} OTHER-HOST:{shown}     (then on OTHER-HOST: chmod 600 {shown})\n"
        f"  or there: export {ENV_VAR}=...     (the contents of {path})"
    )


def token_matches(presented: str | None, expected: str) -> bool:
    """Constant time: compares SHA-256 digests, so neither the content nor the length of the
    expected token shows in how long a wrong guess takes."""
    if not presented or not expected:
        return False
    a = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
    b = hashlib.sha256(expected.encode("utf-8", "surrogatepass")).digest()
    return hmac.compare_digest(a, b)


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive)."""
    scheme, _, value = (header or "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


# ---- peer proofs: each side shows it holds the token without sending it (issue 18, H1) ----
#
#   client                                   server
#   GET /v1/hello?nonce=NC           ->
#                                    <-      {"nonce": NS, "cert": FP,
#                                             "proof": MAC(server | NC | NS | FP)}
#   checks the proof: the server holds the token (else it sends it nothing at all); over
#   TLS, FP is the SHA-256 of the certificate the server serves, and the client pins every
#   later request to it (transport/tls.py); in cleartext FP is empty
#   METHOD TARGET, Authorization: ExoProof nc=NC, ns=NS, mac=MAC(client | NC | NS | METHOD |
#   TARGET | sha256(body))           ->      checks the MAC; NS is single-use, short-lived
#
# MAC is HMAC-SHA256 keyed by the token; the two labels keep a server's proofs (which anyone
# may ask for) from ever serving as a client's. What travels is nonces and MACs: a device
# that is not a node learns nothing it could replay or use to read the token, except by
# guessing it offline from a MAC, which a generated token (256 bits) makes hopeless.

PROOF_SCHEME = "ExoProof"
NONCE_HEX = 32  # 128-bit nonces, hex
_SERVER, _CLIENT = b"exo-split/1 server proof", b"exo-split/1 client proof"


def _mac(token: str, label: bytes, *parts: str) -> str:
    msg = b"\0".join([label, *(p.encode("utf-8", "surrogatepass") for p in parts)])
    return hmac.new(token.encode("utf-8", "surrogatepass"), msg, hashlib.sha256).hexdigest()


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


def is_nonce(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value) == NONCE_HEX
        and all(c in "0123456789abcdef" for c in value)
    )


def server_proof(token: str, client_nonce: str, server_nonce: str, cert: str = "") -> str:
    """`cert`: the fingerprint of the TLS certificate the answer came over ("" in cleartext)."""
    return _mac(token, _SERVER, client_nonce, server_nonce, cert)


def client_proof(token: str, client_nonce: str, server_nonce: str, method: str, target: str,
                 body: bytes) -> str:  # fmt: skip
    """`target`: the path with its query string, as the request line carries it."""
    digest = hashlib.sha256(body).hexdigest()
    return _mac(token, _CLIENT, client_nonce, server_nonce, method.upper(), target, digest)


def proof_header(token: str, client_nonce: str, server_nonce: str, method: str, target: str,
                 body: bytes = b"") -> str:  # fmt: skip
    mac = client_proof(token, client_nonce, server_nonce, method, target, body)
    return f"{PROOF_SCHEME} nc={client_nonce}, ns={server_nonce}, mac={mac}"


def parse_proof(header: str | None) -> dict[str, str] | None:
    """{'nc', 'ns', 'mac'} of an `Authorization: ExoProof ...` header; None otherwise."""
    scheme, _, rest = (header or "").partition(" ")
    if scheme != PROOF_SCHEME:
        return None
    fields = dict(part.strip().partition("=")[::2] for part in rest.split(","))
    if set(fields) != {"nc", "ns", "mac"} or not (
        is_nonce(fields["nc"]) and is_nonce(fields["ns"])
    ):
        return None
    return fields


class Nonces:
    """The server nonces a node has handed out and not yet seen used: each good once, for
    `ttl` seconds; at most `most` outstanding (the oldest go first), so asking for them
    costs a stranger's memory nothing it can grow."""

    def __init__(self, ttl: float = 30.0, most: int = 4096, clock=time.monotonic):
        self.ttl, self.most, self.clock = ttl, most, clock
        self._open: collections.OrderedDict[str, float] = collections.OrderedDict()

    def issue(self) -> str:
        self._expire()
        while len(self._open) >= self.most:
            self._open.popitem(last=False)
        nonce = new_nonce()
        self._open[nonce] = self.clock() + self.ttl
        return nonce

    def take(self, nonce: str) -> bool:
        """Whether `nonce` was handed out, unused and fresh; it is used up either way."""
        self._expire()
        return self._open.pop(nonce, None) is not None

    def _expire(self) -> None:
        now = self.clock()
        while self._open and next(iter(self._open.values())) < now:
            self._open.popitem(last=False)

    def __len__(self) -> int:
        return len(self._open)
