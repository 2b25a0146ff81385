"""What two intellect-node peers must agree on, and nothing else.

Installed as ``intellect_protocol``. Pure: no sockets, no files, no torch. Every message that crosses the
network is defined here (schemas, msgpack encoding, size limits, signatures), together with the DHT record
keys, the checkpoint manifest and the deterministic task assignment.
"""

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change of a wire format; carried by every envelope."""
