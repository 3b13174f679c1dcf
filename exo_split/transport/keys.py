"""Client API keys: one per person or tool that talks to the decode node's APIs, so that the
shared token (which also lets its holder act as a node) need not be handed to every client,
and so that each client's prefix-cache entries are its own (issue 18, M6: a client cannot
probe another's cached conversation through the report's cached-token figures or TTFT).

The key file (`exo-split keys add NAME`, default ~/.config/exo-split/keys.json, mode 0600)
maps a name to the SHA-256 of its key; the key itself is shown once, when it is made. A node
re-reads the file when it changes, so adding or removing a key needs no restart. A key is
accepted on the client endpoints only (the OpenAI and Anthropic APIs, /v1/generate); the
node-to-node plane (/v1/prefill, /v1/probe, /v1/info) takes the shared token alone.

Each key's requests use a prefix-cache scope of their own, on both nodes: an HMAC of its name
under the shared token (the prefill node learns the scope, never the name). Requests with
the shared token share the "" scope, as before keys existed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path

from exo_split.errors import ExoSplitError

log = logging.getLogger(__name__)
PREFIX = "exo-"  # keys look like exo-<43 url-safe characters>
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def default_keys_file() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "exo-split/keys.json"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def scope_of(token: str, client: str) -> str:
    """The prefix-cache scope of a client ("" for the shared token's holders)."""
    if not client:
        return ""
    return hmac.new(token.encode(), f"scope:{client}".encode(), hashlib.sha256).hexdigest()[:32]


def _load(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ExoSplitError(f"cannot read the key file {path}: {exc}") from exc
    if not isinstance(data, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("sha256"), str) for v in data.values()
    ):
        raise ExoSplitError(f"{path} is not an exo-split key file")
    return data


def _save(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def add_key(path: Path, name: str) -> str:
    """Make a key for `name` (refused if the name is taken); returns the key."""
    if not name or len(name) > 64 or not set(name) <= NAME_CHARS:
        raise ExoSplitError(f"a key's name is 1-64 of [A-Za-z0-9._-], got {name!r}")
    data = _load(path)
    if name in data:
        raise ExoSplitError(f"{path} already has a key named {name!r}",
                            hint=f"exo-split keys remove {name} first")  # fmt: skip
    key = PREFIX + secrets.token_urlsafe(32)
    data[name] = {"sha256": _digest(key), "created": int(time.time())}
    _save(path, data)
    return key


def remove_key(path: Path, name: str) -> None:
    data = _load(path)
    if name not in data:
        raise ExoSplitError(f"{path} has no key named {name!r}")
    del data[name]
    _save(path, data)


def list_keys(path: Path) -> dict[str, dict]:
    return _load(path)


class KeyRing:
    """The node's view of the key file, re-read when its modification time or size moves
    (one stat per check)."""

    def __init__(self, path: Path | None):
        self.path = path
        self._stamp: tuple | None = None
        self._digests: dict[str, str] = {}  # sha256 -> name
        self._lock = threading.Lock()

    def match(self, presented: str | None) -> str | None:
        """The name of the key presented, or None. The digest of the presented key is looked
        up, so how long a wrong guess takes does not depend on the keys."""
        if not presented or self.path is None or not presented.startswith(PREFIX):
            return None
        self._refresh()
        return self._digests.get(_digest(presented))

    def _refresh(self) -> None:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        with self._lock:
            if stamp == self._stamp:
                return
            try:
                data = _load(self.path) if stamp is not None else {}
            except ExoSplitError as exc:  # no key is accepted until it is fixed
                log.warning("%s; client keys are refused until it is fixed", exc)
                data = {}
            self._digests = {v["sha256"]: name for name, v in data.items()}
            self._stamp = stamp
