"""The roles: one process each, built from the subsystems.

``volunteer`` is what every joining node shares (DHT, run spec, following the relay tree); ``inference``,
``validator_node`` and ``relay_node`` are the volunteer roles; ``trainer`` owns the run, with its node registry
(``trainer_registry``), validation pipeline (``trainer_validation``), checkpoints, spool and replay
(``trainer_checkpoint``) and admission policy (``admission``) in modules beside it.

May import: every subsystem (``p2p``, ``weights``, ``policy``, ``judging``), ``config`` and ``runtime``;
nothing imports a role but the entry points (``cli``, ``demo``, ``launch``).
"""
