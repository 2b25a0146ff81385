"""intellect-node: the peer-to-peer daemon for decentralized asynchronous RL (installed as ``intellect_node``).

One module per service: ``dht`` (membership), ``weights`` (checkpoint origin and client), ``transport``
(rollout delivery over libp2p streams), ``trainer`` and ``inference`` (the roles), ``status`` (health,
status and metrics over HTTP), ``cli`` and ``demo`` (entry points). Imports flow one way: node → protocol,
kernels.
"""

__version__ = "0.1.0"
