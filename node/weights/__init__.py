"""Weight distribution: every signed policy version from the trainer to every node, through a tree of relays.

Owns checkpoint files and their signed manifests (``files``), one run's folder of complete and partial versions
(``store``), the HTTP shard server and relay slots (``relay``), sharing a node's upload (``pacing``) and who
may hold a slot (``auth``), receiving a version from several sources (``fetch``), the stripes each version is
spread in (``stripes``: pure planning, also run by benchmarks/simulate.py), choosing and keeping a parent in each
(``tree`` plans, ``links`` and ``follower`` act).

May import: ``p2p`` (metrics, DHT membership), ``intellect_node.aio``, ``intellect_protocol``; never ``policy``,
``judging`` or a role.
"""
