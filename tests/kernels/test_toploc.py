"""TOPLOC: our vectorized proofs are byte-for-byte those of the reference ``toploc`` 0.1.6, and each side
verifies the other's proofs with the same statistics.

The reference is a test dependency built from source (its wheel does not import beside torch 2.13):
``pip install --no-build-isolation --no-binary toploc toploc==0.1.6`` (.ci/run does it).
"""

from __future__ import annotations

import pytest
import toploc as reference
import torch

from intellect_kernels import toploc


def _activations(seed: int, prompt: int, steps: int, hidden: int, scale: float = 3.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    first = (torch.randn(prompt, hidden, generator=g) * scale).to(torch.bfloat16)
    return [first] + [(torch.randn(1, hidden, generator=g) * scale).to(torch.bfloat16) for _ in range(steps)]


CASES = [
    # (seed, prompt tokens, decode steps, hidden): short and long, a partial last chunk, and a prefill larger
    # than 65497 values (the modulus search then goes below the prime)
    (0, 5, 64, 576),
    (1, 17, 100, 576),
    (2, 1, 1, 128),
    (3, 150, 33, 576),
    (4, 3, 7, 960),
]


@pytest.mark.parametrize(("seed", "prompt", "steps", "hidden"), CASES)
def test_proofs_are_byte_identical_to_the_reference(seed: int, prompt: int, steps: int, hidden: int) -> None:
    acts = _activations(seed, prompt, steps, hidden)
    ours = toploc.build_proofs(acts, decode_batching_size=32, topk=128)
    theirs = reference.build_proofs_bytes(acts, decode_batching_size=32, topk=128)
    assert ours == theirs
    assert all(len(p) == 258 for p in ours)
    assert len(ours) == 1 + (steps + 31) // 32


def test_the_modulus_goes_below_the_prime_when_indices_collide() -> None:
    acts = _activations(3, 150, 0, 576)  # 86400 values: indices above 65497
    (ours,) = toploc.build_proofs(acts, 32, 128)
    (theirs,) = reference.build_proofs_bytes(acts, 32, 128)
    assert ours == theirs
    modulus, _ = toploc.decode(ours)
    indices = acts[0].view(-1).abs().topk(128).indices
    assert int(indices.max()) >= toploc.PRIME or modulus == toploc.PRIME
    assert len(set((indices % modulus).tolist())) == 128


def _perturbed(acts: list[torch.Tensor], seed: int, rel: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(a.float() * (1 + rel * torch.randn(a.shape, generator=g))).to(torch.bfloat16) for a in acts]


@pytest.mark.parametrize("rel", [0.0, 0.005, 0.05, 1.0])
def test_each_side_verifies_the_others_proofs_with_the_same_statistics(rel: float) -> None:
    """Decode-only proofs over (steps, hidden) rows, as the reference's C++ verifier takes them."""
    acts = _activations(7, 1, 96, 576)[1:]
    rows = torch.cat(acts)
    ours = toploc.build_proofs(acts, 32, 128, skip_prefill=True)
    theirs = reference.build_proofs_bytes(acts, 32, 128, skip_prefill=True)
    assert ours == theirs
    checked = _perturbed(acts, 8, rel)
    ref_results = reference.verify_proofs_bytes(torch.cat(checked), theirs, 32, 128, skip_prefill=True)
    our_results = toploc.verify_proofs(checked, ours, 32, 128, skip_prefill=True)
    assert [tuple(r) for r in our_results] == [
        (r.exp_mismatches, r.mant_err_mean, r.mant_err_median) for r in ref_results
    ]
    if rel == 0.0:
        assert all(r == (0, 0.0, 0.0) for r in our_results)
        assert rows.shape == (96, 576)
    if rel >= 0.05:
        assert all(r.mant_err_mean > 5 or r.exp_mismatches > 20 for r in our_results)


def test_a_proof_of_the_wrong_length_or_modulus_fails_without_crashing() -> None:
    acts = _activations(9, 4, 10, 576)
    proofs = toploc.build_proofs(acts, 32, 128)
    chunks = toploc.chunk_activations(acts, 32)
    broken = [proofs[0][:-2], b"\x00\x00" + proofs[1][2:]]  # truncated; modulus 0
    for r in toploc.verify_chunk_proofs(chunks, broken, 128):
        assert r.exp_mismatches == 128 and r.mant_err_mean == toploc.NO_MATCH
    with pytest.raises(ValueError, match="bf16"):
        toploc.build_proofs([a.float() for a in acts], 32, 128)
    with pytest.raises(ValueError, match="fewer than topk"):
        toploc.build_proofs([torch.zeros(1, 64, dtype=torch.bfloat16)], 32, 128)
