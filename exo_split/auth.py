"""The shared token that both node agents and the client present (DESIGN §4).

Never logged, never advertised, compared in constant time. A node started without one
generates it and stores it with mode 0600 so the user can copy it to the other machine.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from exo_split.errors import ExoSplitError

ENV_VAR = "EXO_SPLIT_TOKEN"


def default_token_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "exo-split" / "token"


def read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ExoSplitError(f"cannot read the token file {path}: {exc.strerror}") from exc
    if not token:
        raise ExoSplitError(f"the token file {path} is empty")
    return token


def resolve_token(
    token_file: Path | None, environ: dict[str, str], *, create: bool
) -> tuple[str, str]:
    """(token, where it came from). `create`: generate and store one when none is found."""
    if environ.get(ENV_VAR):
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
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, f"{path} (new)"


def token_matches(presented: str | None, expected: str) -> bool:
    if not presented:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


def bearer(header: str | None) -> str | None:
    if header and header.startswith("Bearer "):
        return header[len("Bearer ") :].strip()
    return None
