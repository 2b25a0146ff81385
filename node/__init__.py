"""intellect-node: the peer-to-peer daemon for decentralized asynchronous RL (installed as ``intellect_node``).

One folder per subsystem, and at the top only the entry points:

- ``p2p/``: peer-to-peer plumbing: DHT membership, libp2p rollout transport, the HTTP server, metrics, keys.
- ``weights/``: weight distribution: checkpoint files, the store, the shard server, the fetcher, the relay tree.
- ``policy/``: the model: building and loading it, generation backends, the training engine, FSDP.
- ``judging/``: judging rollouts: task sets, rewards and verifiers, the validator, held-out evaluation.
- ``roles/``: the processes a volunteer or a researcher runs: trainer, inference, validator, relay.
- ``cli``, ``config``, ``launch``, ``runtime``, ``demo``: entry points and what every role's process shares.

Imports flow one way: entry points -> roles -> subsystems -> protocol, kernels; ``p2p`` and ``policy`` import no
other subsystem, ``weights`` may import ``p2p`` and ``judging`` may import ``policy``
(tests/test_layout.py checks it).
"""

__version__ = "0.1.0"
