"""TOPLOC: our vectorized proofs are byte-for-byte those of the reference ``toploc`` 0.1.6, over bf16 and fp16
activations; for bf16 each side verifies the other's proofs with the same statistics. The reference cannot verify
fp16 (it refuses the dtype), so our fp16 statistics are checked against the reference's own polynomial
evaluation with the fields split at fp16's boundaries.

The reference is a test dependency built from source (its wheel does not import beside torch 2.13):
``pip install --no-build-isolation --no-binary toploc toploc==0.1.6`` (.ci/run does it).
"""

from __future__ import annotations

import pytest
import toploc as reference
import torch

from intellect_kernels import toploc
from intellect_node.config import RunConfig


def _activations(
    seed: int, prompt: int, steps: int, hidden: int, scale: float = 3.0, dtype: torch.dtype = torch.bfloat16
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    first = (torch.randn(prompt, hidden, generator=g) * scale).to(dtype)
    return [first] + [(torch.randn(1, hidden, generator=g) * scale).to(dtype) for _ in range(steps)]


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
    return [(a.float() * (1 + rel * torch.randn(a.shape, generator=g))).to(a.dtype) for a in acts]


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
    with pytest.raises(ValueError, match="fewer than topk"):
        toploc.build_proofs([torch.zeros(1, 64, dtype=torch.bfloat16)], 32, 128)


# fp16 (GPUs without bf16: T4, V100)

FP16_CASES = [
    # (seed, prompt tokens, decode steps, hidden, scale): as CASES, and one whose largest values overflow to inf
    (0, 5, 64, 576, 3.0),
    (1, 17, 100, 576, 3.0),
    (2, 1, 1, 128, 3.0),
    (3, 150, 33, 576, 3.0),
    (5, 4, 40, 576, 2e4),
]


@pytest.mark.parametrize(("seed", "prompt", "steps", "hidden", "scale"), FP16_CASES)
def test_fp16_proofs_are_byte_identical_to_the_reference(
    seed: int, prompt: int, steps: int, hidden: int, scale: float
) -> None:
    acts = _activations(seed, prompt, steps, hidden, scale, torch.float16)
    ours = toploc.build_proofs(acts, 32, 128)
    theirs = reference.build_proofs_bytes(acts, 32, 128)
    assert ours == theirs
    assert len(ours) == 1 + (steps + 31) // 32
    assert ours != toploc.build_proofs([a.bfloat16() for a in acts], 32, 128)  # the raw fp16 bits are committed
    if scale > 1e4:  # some values past fp16's largest finite one, 65504
        assert any(bool(a.isinf().any()) for a in acts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_colliding_indices_give_the_references_smaller_modulus(dtype: torch.dtype) -> None:
    """The 64 largest values sit at i and i + 65497: no index set mod 65497 is injective."""
    acts = _activations(11, 150, 0, 576, 1.0, dtype)  # 86400 values
    flat = acts[0].view(-1)
    for i in range(64):
        flat[i * 7] = 100.0 + i
        flat[i * 7 + toploc.PRIME] = -200.0 - i
    (ours,) = toploc.build_proofs(acts, 32, 128)
    (theirs,) = reference.build_proofs_bytes(acts, 32, 128)
    assert ours == theirs
    modulus, _ = toploc.decode(ours)
    assert modulus < toploc.PRIME
    assert toploc.verify_proofs(acts, [ours], 32, 128) == [(0, 0.0, 0.0)]


def _fp16_oracle(chunks: list[torch.Tensor], proofs: list[bytes], topk: int) -> list[tuple[int, float, float]]:
    """The reference's C++ verifier, element by element, with the reference's polynomial decoding and evaluation,
    and the fields split at fp16's boundaries (exponent bits 10-14, mantissa bits 0-9) instead of bf16's."""
    out = []
    for chunk, proof in zip(chunks, proofs, strict=True):
        poly = reference.ProofPoly.from_bytes(proof)
        indices = chunk.abs().topk(topk).indices
        claimed = reference.poly.evaluate_polynomials(poly.coeffs, [i % poly.modulus for i in indices.tolist()])
        own = (chunk[indices].view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
        exp_mis = [(c & 0x7C00) >> 10 != (o & 0x7C00) >> 10 for c, o in zip(claimed, own, strict=True)]
        errs = sorted(abs((c & 0x3FF) - (o & 0x3FF)) for c, o, m in zip(claimed, own, exp_mis, strict=True) if not m)
        if errs:
            out.append((sum(exp_mis), sum(errs) / len(errs), float(errs[len(errs) // 2])))
        else:
            out.append((sum(exp_mis), 2.0**64, 2.0**64))
    return out


@pytest.mark.parametrize("rel", [0.0, 0.0005, 0.005, 0.05, 1.0])
def test_fp16_verification_of_the_references_proofs(rel: float) -> None:
    """Honest activations match exactly; perturbed ones are caught, more the larger the perturbation."""
    acts = _activations(7, 3, 96, 576, dtype=torch.float16)
    theirs = reference.build_proofs_bytes(acts, 32, 128)
    checked = _perturbed(acts, 8, rel)
    ours = toploc.verify_proofs(checked, theirs, 32, 128)
    assert [tuple(r) for r in ours] == _fp16_oracle(toploc.chunk_activations(checked, 32), theirs, 128)
    assert len(ours) == 4
    if rel == 0.0:
        assert all(r == (0, 0.0, 0.0) for r in ours)
    if rel >= 0.005:  # ~5 fp16 units of mantissa error per value at 0.5 %
        assert all(r.mant_err_median >= 2 for r in ours)
    if rel >= 0.05:
        assert all(r.mant_err_mean > 20 or r.exp_mismatches > 20 for r in ours)


def test_the_reference_refuses_to_verify_fp16() -> None:
    """Why fp16 verification is checked against an oracle: 0.1.6's ``get_fp_parts`` takes only fp32 and bf16.
    (Its C++ path, given a tensor, throws inside a worker thread and aborts the process: not called here.)"""
    acts = _activations(7, 3, 10, 576, dtype=torch.float16)
    proofs = reference.build_proofs_bytes(acts, 32, 128)
    with pytest.raises(RuntimeError, match="Float32 or BFloat16"):
        reference.verify_proofs_bytes(acts, proofs, 32, 128)


def test_a_proof_fails_against_the_other_dtype_and_mixed_batches_split_each_chunk_by_its_own() -> None:
    acts = _activations(12, 4, 40, 576, dtype=torch.float16)
    chunks16 = toploc.chunk_activations(acts, 32)
    chunks_bf = [c.bfloat16() for c in chunks16]
    proofs16 = toploc.build_chunk_proofs(chunks16, 128)
    proofs_bf = toploc.build_chunk_proofs(chunks_bf, 128)
    for r in toploc.verify_chunk_proofs(chunks_bf, proofs16, 128) + toploc.verify_chunk_proofs(
        chunks16, proofs_bf, 128
    ):
        assert r.exp_mismatches > 64
    mixed = toploc.verify_chunk_proofs(chunks16 + chunks_bf, proofs16 + proofs_bf, 128)
    assert mixed == [(0, 0.0, 0.0)] * (2 * len(chunks16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int16])
def test_other_dtypes_are_refused_naming_the_accepted_ones(dtype: torch.dtype) -> None:
    acts = [a.to(dtype) for a in _activations(9, 4, 10, 576)]
    proofs = toploc.build_proofs(_activations(9, 4, 10, 576), 32, 128)
    accepted = r"bf16 or fp16 activations \(torch.bfloat16, torch.float16\), got " + str(dtype)
    with pytest.raises(ValueError, match=accepted):
        toploc.build_proofs(acts, 32, 128)
    with pytest.raises(ValueError, match=accepted):
        toploc.verify_proofs(acts, proofs, 32, 128)


def test_a_top_k_index_taken_at_the_boundary_is_one_mismatch_not_a_mantissa_error() -> None:
    """Where a chunk's 64th and 65th magnitudes are within rounding, the validator's top-64 can hold an index the
    producer never committed to; the polynomial gives a random value there. One time in ~256 its exponent matches,
    and the reference's statistics put its random mantissa into the mean (an honest fp32 producer was banned for a
    mean of 0.59 with 0 mismatches and median 0). With the validators' ``foreign_share`` it is one mismatch."""
    g = torch.Generator().manual_seed(0)
    producer, validator = [], []
    for _ in range(4000):
        chunk = torch.randn(128, generator=g).to(torch.bfloat16)
        order = chunk.float().abs().argsort(descending=True)
        mine = chunk.clone()  # the 65th raised just above the 64th: one index of the top-64 differs
        mine[order[64]] = torch.sign(chunk[order[64]].float()) * chunk[order[63]].float().abs() * 1.01
        producer.append(chunk)
        validator.append(mine.to(torch.bfloat16))
    proofs = toploc.build_chunk_proofs(producer, 64)
    reference_stats = toploc.verify_chunk_proofs(validator, proofs, 64)
    assert any(r.exp_mismatches == 0 and r.mant_err_mean > 0.266 for r in reference_stats)  # what banned
    ours = toploc.verify_chunk_proofs(validator, proofs, 64, foreign_share=toploc.FOREIGN_SHARE)
    assert max(r.exp_mismatches for r in ours) == 1
    # a foreign value within the cap (16 units) whose exponent matched stays in the mean: at most 16/64 = 0.25
    assert max(r.mant_err_mean for r in ours) <= 16 / 64 < RunConfig().verify.max_mant_err_mean
    assert max(r.mant_err_median for r in ours) == 0.0


def test_large_errors_far_from_the_boundary_stay_in_the_mean(monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer may not hide changed values behind the foreign rule: three of its largest values moved by a quarter
    of their mantissa range (exponents kept, within the run's three mismatches) would each be 'foreign' without
    the window, and the mean would show nothing. They are not near the k-th magnitude, so the mean shows them."""
    g = torch.Generator().manual_seed(1)
    honest, committed = [], []
    for _ in range(64):
        chunk = torch.randn(128, generator=g).to(torch.bfloat16)
        order = chunk.float().abs().argsort(descending=True)
        moved = chunk.clone()
        for i in order[:3]:  # its three largest, each a quarter of the mantissa range (32 units of 128) up
            bits = moved[i : i + 1].view(torch.int16)
            bits += 32 if (int(bits) & 0x7F) < 96 else -32
        honest.append(chunk)
        committed.append(moved)
    proofs = toploc.build_chunk_proofs(committed, 64)
    ours = toploc.verify_chunk_proofs(honest, proofs, 64, foreign_share=toploc.FOREIGN_SHARE)
    limits = RunConfig().verify
    assert all(r.exp_mismatches == 0 for r in ours)
    assert min(r.mant_err_mean for r in ours) >= 3 * 32 / 64 > limits.max_mant_err_mean
    monkeypatch.setattr(toploc, "FOREIGN_WINDOW", float("inf"))
    hidden = toploc.verify_chunk_proofs(honest, proofs, 64, foreign_share=toploc.FOREIGN_SHARE)
    assert all(r.exp_mismatches == 3 and r.mant_err_mean == 0.0 for r in hidden)  # what the window closes
