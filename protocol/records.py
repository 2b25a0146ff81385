"""DHT keys and record lifetimes. See docs/dht.md for the formats, for readers outside this project.

Every value stored is the bytes of a signed envelope (``envelope.seal``), kept under a subkey equal to the
signer's node id, so a record can be checked by anyone from the value alone:

- ``intellect-node/<run_id>/spec``  subkey ``<run_id>``: the RunSpec, signed by the run key.
- ``intellect-node/<run_id>/nodes`` subkey ``<node_id>``: each node's NodeRecord, signed by that node.
- ``intellect-node/<run_id>/trainer`` subkey ``<run_id>``: the trainer's NodeRecord again, under a key nobody
  else can write to (our validators refuse other signers), so a flood of node records cannot hide it.

Validators also refuse an expiration further ahead than the record's TTL (plus clock skew) and a node record
whose ``updated`` is stale, so nobody can pin an old signed record in place by replaying it with a far expiry.
"""

from __future__ import annotations

KEY_PREFIX = "intellect-node/"
SPEC_TTL_S = 120.0
NODE_TTL_S = 30.0
"""A node republishes its record well within this, so a silent node drops out of the swarm in ``NODE_TTL_S``."""
REPUBLISH_S = 8.0
CLOCK_SKEW_S = 120.0


def spec_key(run_id: str) -> str:
    return f"{KEY_PREFIX}{run_id}/spec"


def nodes_key(run_id: str) -> str:
    return f"{KEY_PREFIX}{run_id}/nodes"


def trainer_key(run_id: str) -> str:
    return f"{KEY_PREFIX}{run_id}/trainer"


GOSSIP_TOPICS = ("versions", "rollouts", "verdicts")
"""The run's pubsub topics: new-version notices (run key), rollout announcements (producers), verdicts and
acknowledgements (validators and the trainer). Each message is one signed envelope of at most
``Channel.GOSSIP`` bytes (``Channel.VERDICT`` on ``verdicts``): bodies travel over streams."""


def topic(run_id: str, name: str) -> str:
    if name not in GOSSIP_TOPICS:
        raise ValueError(f"no gossip topic {name!r}")
    return f"{KEY_PREFIX}{run_id}/{name}/v1"
