"""A node's persistent Ed25519 key on disk (``<data_dir>/node.key``, raw 32 bytes, mode 0600)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from intellect_protocol.identity import Identity

logger = logging.getLogger(__name__)


def load_or_create(path: Path) -> Identity:
    if path.exists():
        raw = path.read_bytes()
        if len(raw) != 32:
            raise SystemExit(
                f"{path} is not an intellect-node key (expected 32 bytes, found {len(raw)}); "
                "move it away to create a new identity, or point --data-dir elsewhere"
            )
        return Identity.from_private_bytes(raw)
    identity = Identity.generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(identity.private_bytes())
    tmp.replace(path)
    logger.info("created new identity node_id=%s path=%s", identity.node_id, path)
    return identity
