"""The roles: one process each, built from the subsystems.

``volunteer`` is what every joining node shares (DHT, run spec, following the relay tree); ``inference``,
``validator_node`` and ``relay_node`` are the volunteer roles; ``trainer`` owns the run, with its node registry
(``trainer_registry``), judging pipeline (``trainer_validation.Judging``, a part with its own state), the state
its parts share (``trainer_state``: the training queue, the batches in flight, the reward curve, the ledger),
checkpoints, spool and replay (``trainer_checkpoint``), gossip (``trainer_gossip``) and admission policy
(``admission``) in modules beside it.

May import: every subsystem (``p2p``, ``weights``, ``policy``, ``judging``), ``config`` and ``runtime``;
nothing imports a role but the entry points (``cli``, ``demo``, ``launch``).
"""
