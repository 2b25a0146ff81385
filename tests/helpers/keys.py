"""Real keys for made-up nodes: the tests of relay slots sign their requests as the nodes they play."""

from __future__ import annotations

from intellect_protocol.identity import Identity


class Keys:
    """Node ids with their signing keys: ``new()`` makes a node, ``keys[node_id]`` is its key."""

    def __init__(self) -> None:
        self._by_id: dict[str, Identity] = {}
        self._by_label: dict[str, str] = {}

    def new(self) -> str:
        """A fresh node's id."""
        key = Identity.generate()
        self._by_id[key.node_id] = key
        return key.node_id

    def named(self, label: str) -> str:
        """The id of the node a test calls ``label``: the same id for the same label."""
        if label not in self._by_label:
            self._by_label[label] = self.new()
        return self._by_label[label]

    def __getitem__(self, node_id: str) -> Identity:
        return self._by_id[node_id]
