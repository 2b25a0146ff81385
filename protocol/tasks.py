"""Deterministic task assignment and the built-in verifiable task family.

A worker cannot choose its problems: the tasks of its batch ``b`` on weight version ``v`` are derived from
``(run seed, node id, v, b, slot)`` by SHA-256, and any receiver re-derives them. The reward is computed by
the receiver from the completion text alone; nothing a worker says about its reward is used.

``arithmetic``: ``a+b=`` with operands in ``[0, max_operand]``. Reward 1.0 for the exact integer followed by
end of sequence, 0.2 for a well-formed but wrong integer (so a model starting from random weights first learns
the format), 0.0 otherwise.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

ARITHMETIC_ALPHABET = "0123456789+="
_INTEGER = re.compile(r"-?[0-9]{1,12}")


@dataclass(frozen=True)
class Task:
    prompt: str
    answer: str


def assignment_seed(run_seed: int, node_id: str, version: int, batch_index: int, slot: int) -> int:
    digest = hashlib.sha256(f"{run_seed}/{node_id}/{version}/{batch_index}/{slot}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def arithmetic_task(seed: int, max_operand: int) -> Task:
    a = seed % (max_operand + 1)
    b = (seed // (max_operand + 1)) % (max_operand + 1)
    return Task(prompt=f"{a}+{b}=", answer=str(a + b))


def assigned_task(run_seed: int, node_id: str, version: int, batch_index: int, slot: int, max_operand: int) -> Task:
    return arithmetic_task(assignment_seed(run_seed, node_id, version, batch_index, slot), max_operand)


def arithmetic_reward(completion: str, answer: str, terminated: bool) -> float:
    """Reward of a completion (text before end of sequence); ``terminated``: it ended with EOS."""
    if not terminated or _INTEGER.fullmatch(completion) is None or len(completion) > 100:
        return 0.0
    return 1.0 if int(completion) == int(answer) else 0.2


def sampling_seed(run_seed: int, node_id: str, version: int, batch_index: int, slot: int, sample: int) -> int:
    """The seed of one completion's sampling noise: a validator re-derives every token from it."""
    digest = hashlib.sha256(f"sample/{run_seed}/{node_id}/{version}/{batch_index}/{slot}/{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little")
