"""Finding the other node: mDNS (mdns.py, with its TXT record in txt.py and the choice of
addresses in addresses.py) with a static `--peer host:port` fallback (static.py); both yield
`PeerInfo`, merged and assigned roles in peers.py; presence.py keeps a node's view current;
find.py runs both at once for the CLI.

No torch or mlx here: this package imports on any machine.
"""

from .find import NO_PEERS_HINT, Found, find_peers
from .mdns import (
    SERVICE_TYPE,
    Advertiser,
    Browser,
    DiscoveryError,
    browse,
    open_zeroconf,
)
from .peers import (
    NodeInfo,
    PeerInfo,
    choose_pair,
    choose_roles,
    format_url,
    merge_peers,
    new_node_id,
    prefill_candidates,
)
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
from .txt import TXT_KEYS, check_txt, node_from_txt, node_txt

__all__ = [
    "ENV_VAR",
    "NO_PEERS_HINT",
    "SERVICE_TYPE",
    "TXT_KEYS",
    "Advertiser",
    "Browser",
    "DiscoveryError",
    "Found",
    "NodeInfo",
    "PeerAddress",
    "PeerInfo",
    "ProbeFailure",
    "StaticProbe",
    "browse",
    "check_txt",
    "choose_pair",
    "choose_roles",
    "find_peers",
    "format_url",
    "merge_peers",
    "new_node_id",
    "node_from_txt",
    "node_txt",
    "open_zeroconf",
    "parse_peer",
    "parse_peers",
    "peers_from_env",
    "prefill_candidates",
    "probe_static",
]
