"""What the benchmark scripts beside this folder share (they import it as ``harness``, their own folder being
first on ``sys.path``):

- ``netns``: test hosts in Linux network namespaces, each host's upload shaped by tc (broadcast.py, gossip.py,
  chaos.py).
- ``delay_proxy``: a transparent TCP proxy that delays every connection; gossip.py runs it inside a namespace.
- ``broadcast_origin``: the origin process of broadcast.py (the trainer's weight store and shard server alone).
- ``broadcast_logs``: where a netns broadcast's time went, from the folder ``broadcast.py --keep`` leaves.
- ``models``: the models the validator benchmarks measure (calibrate_validator.py, toploc_detect.py,
  toploc_speed.py).
- ``docs``: a benchmark's table into its block of a docs page (``--write-doc``).
"""
