"""The mDNS TXT record of a node, and the guard that keeps credentials out of it.

TXT record, all values strings:

    key    meaning                              example
    pv     protocol version                     "1"
    id     node id                              "3f2a...c1" (32 hex)
    name   human-readable node name             "spark"
    be     backend                              "torch" | "mlx"
    dev    device                               "cuda" | "metal" | "cpu"
    model  model name                           "Llama-3.1-8B-Instruct"
    fp     model fingerprint (must match)       "9c1e..."
    roles  comma-separated roles                "prefill,decode"
    ptps   measured prefill tokens/s            "10450.3"  (absent until measured)
    dtps   measured decode tokens/s             "41.2"     (absent until measured)
    q      the weights' quantization            "q4g64-affine" (absent: full precision)

The auth token never goes into mDNS: `check_txt` refuses token-like keys (and any
value listed in `never_publish`) on every publish.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from .peers import NodeInfo

TXT_KEYS = ("pv", "id", "name", "be", "dev", "model", "fp", "roles", "ptps", "dtps", "q")
_FORBIDDEN_KEY = re.compile(r"token|auth|secret|passw|credential|api[-_]?key", re.IGNORECASE)


def check_txt(txt: Mapping[str, str], *, never_publish: Iterable[str] = ()) -> None:
    """Raise ValueError if a TXT record would leak a credential or is malformed.

    Keys that look like a credential (token, auth, secret, password, api key) are refused
    outright; `never_publish` lists values (e.g. the node's token) that must not appear in
    any value. The message never repeats the secret.
    """
    secrets = [s for s in never_publish if s]
    for key, value in txt.items():
        if _FORBIDDEN_KEY.search(key):
            raise ValueError(f"refusing to publish TXT key {key!r}: credentials never go in mDNS")
        if any(secret in key or secret in value for secret in secrets):
            raise ValueError(f"refusing to publish TXT key {key!r}: its value contains a secret")
        if len(key.encode()) + 1 + len(value.encode()) > 255:
            raise ValueError(f"TXT entry {key!r} is longer than 255 bytes: {value[:40]!r}...")


def _format_tps(tps: float) -> str:
    return f"{tps:.6g}"


def node_txt(node: NodeInfo) -> dict[str, str]:
    """The TXT record for `node` (see the module docstring for the keys)."""
    txt = {
        "pv": str(node.protocol),
        "id": node.node_id,
        "name": node.name,
        "be": node.backend,
        "dev": node.device,
        "model": node.model,
        "fp": node.fingerprint,
        "roles": ",".join(node.roles),
    }
    if node.prefill_tps is not None:
        txt["ptps"] = _format_tps(node.prefill_tps)
    if node.decode_tps is not None:
        txt["dtps"] = _format_tps(node.decode_tps)
    if node.quantization is not None:
        txt["q"] = node.quantization
    return txt


def node_from_txt(txt: Mapping[str, str | None]) -> NodeInfo:
    """Parse a received TXT record; ValueError names what is missing or wrong."""
    required = ("pv", "id", "be", "dev", "model", "fp", "roles")
    missing = [k for k in required if not txt.get(k)]
    if missing:
        raise ValueError(f"TXT record lacks {', '.join(missing)}")
    try:
        protocol = int(txt["pv"])  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"TXT pv must be an integer, got {txt['pv']!r}") from exc
    return NodeInfo(
        node_id=txt["id"],  # type: ignore[arg-type]
        name=txt.get("name") or txt["id"],  # type: ignore[arg-type]
        backend=txt["be"],  # type: ignore[arg-type]
        device=txt["dev"],  # type: ignore[arg-type]
        model=txt["model"],  # type: ignore[arg-type]
        fingerprint=txt["fp"],  # type: ignore[arg-type]
        protocol=protocol,
        roles=tuple(r for r in (txt["roles"] or "").split(",") if r),
        prefill_tps=txt.get("ptps"),  # type: ignore[arg-type]  # NodeInfo parses
        decode_tps=txt.get("dtps"),  # type: ignore[arg-type]
        quantization=txt.get("q") or None,
    )
