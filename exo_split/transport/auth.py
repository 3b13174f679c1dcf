"""The shared token that both node agents and the client present (DESIGN §4).

Never logged, never advertised, never echoed in an error, compared in constant time. A node
started without one generates it, stores it with mode 0600 under the user's config directory
and says how to copy it to the other machine.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
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
