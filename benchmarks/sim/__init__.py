"""The broadcast simulator: a checkpoint to thousands of volunteers through the relay tree, on a simulated clock.

Run it with ``python benchmarks/simulate.py`` (its docstring: the model, the options, what it prints). The parts,
each importing only the ones listed before it:

- ``net``: the flow-level network (rates shared max-min fair, cut-through with a per-hop lag) and the clock.
- ``fetch``: where each node's shards come from (the node's ``sources`` and ``fetch`` code), over the view of the
  swarm it needs (``fetch.Swarm``).
- ``swarm``: the control plane: nodes that publish records and choose parents with the node's ``stripes`` and
  ``tree`` code; what lives in async node code is mirrored, marked MIRROR.
- ``scenario``: the volunteers, the churn and the bound a run is compared with.
- ``runs``: ours (``run_ours``) and shardcast (``run_shardcast``) on a scenario.
"""
