"""Peer-to-peer plumbing: how a node finds peers and talks to them.

Owns DHT membership and record validation (``dht``), the rollout transport seam (``rollouts``: a sink and a
source per transport, by name) and its built-in libp2p transport (``transport``: size-bounded requests over
libp2p streams), the node's HTTP server (``http``: /health, /status, /metrics and the routes other services
mount), Prometheus metrics (``metrics``) and the node's persistent identity (``keys``).

May import: ``intellect_protocol``, ``intellect_node.aio`` and the top package's ``__version__``; no other subsystem,
no role.
"""
