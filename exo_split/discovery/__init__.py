"""Finding the other node: mDNS (mdns.py) with a static `--peer host:port` fallback
(static.py); both yield `PeerInfo`, merged and assigned roles in peers.py.

No torch or mlx here: this package imports on any machine.
"""

from .mdns import (
    SERVICE_TYPE,
    TXT_KEYS,
    Advertiser,
    Browser,
    DiscoveryError,
    browse,
    check_txt,
    node_from_txt,
    node_txt,
    open_zeroconf,
)
from .peers import NodeInfo, PeerInfo, choose_roles, merge_peers, new_node_id
from .static import (
    ENV_VAR,
    PeerAddress,
    ProbeFailure,
    StaticProbe,
    parse_peer,
    parse_peers,
    peers_from_env,
    probe_static,
)

__all__ = [
    "ENV_VAR",
    "SERVICE_TYPE",
    "TXT_KEYS",
    "Advertiser",
    "Browser",
    "DiscoveryError",
    "NodeInfo",
    "PeerAddress",
    "PeerInfo",
    "ProbeFailure",
    "StaticProbe",
    "browse",
    "check_txt",
    "choose_roles",
    "merge_peers",
    "new_node_id",
    "node_from_txt",
    "node_txt",
    "open_zeroconf",
    "parse_peer",
    "parse_peers",
    "peers_from_env",
    "probe_static",
]
