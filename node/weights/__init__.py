"""Weight distribution: every signed policy version from the trainer to every node, through a tree of relays.

Owns checkpoint files and their signed manifests (``files``), one run's folder of complete and partial versions
(``store``), the HTTP shard server and relay slots (``relay``) and who may hold them (``auth``), receiving a
version from several sources (``fetch``), choosing and keeping a parent (``tree`` plans, ``follower`` acts).

May import: ``p2p`` (metrics, DHT membership), ``intellect_node.aio``, ``intellect_protocol``; never ``policy``,
``judging`` or a role.
"""
