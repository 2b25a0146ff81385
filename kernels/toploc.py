"""TOPLOC proofs in vectorized torch, byte-for-byte compatible with the reference ``toploc`` 0.1.6.

A proof commits to the ``topk`` largest-magnitude values of a chunk of hidden states (the prefill, then every
``decode_batching_size`` decode steps), as the polynomial over GF(65497) through the points
(index mod m, the value's 16 bits as an unsigned integer), m being the largest modulus <= 65497 that keeps the
indices distinct. Encoding: m as 2 big-endian bytes, then each coefficient (ascending degree) as 2 big-endian
bytes: 258 bytes for topk=128. A verifier recomputes the hidden states, takes its own top-k, evaluates the
polynomial at those indices and compares the exponent and mantissa fields of the committed values with its own.

Activations are bf16 or fp16 (GPUs without bf16 compute in fp16); nothing else is accepted. The proof does not
say which: both sides must use the run's dtype, and a proof checked against the other dtype fails. Building is
the reference's for both (it commits to the raw 16 bits of either). Verifying fp16 is ours: the reference 0.1.6
splits fields with bf16 masks only and refuses fp16 activations (``get_fp_parts``), so fp16 values are split
at the IEEE half boundary (exponent bits 10-14, mantissa bits 0-9) and checked with the reference's statistics
otherwise. Mantissa errors are then in fp16 units (2^-10 relative, 8x finer than bf16's): fp16 thresholds need
their own calibration.

Where the reference's two verification paths differ (its Python path does not reduce indices by the modulus
and takes ``statistics.median``), this follows its C++ path: indices reduced mod m, median = sorted[n // 2].
Everything is batched over chunks: one Newton interpolation for all proofs of a generation step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

PRIME = 65497
TOPK = 128
DECODE_BATCH = 32
NO_MATCH = float(2**64)
"""Mean and median reported when no exponent matched (as the reference)."""
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
"""The activation dtypes proofs commit to, and their mantissa widths: the exponent is bits [width, 15)."""

_inverse: torch.Tensor | None = None


class VerificationResult(NamedTuple):
    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float


def proof_bytes(topk: int = TOPK) -> int:
    return 2 + 2 * topk


def _inverses() -> torch.Tensor:
    """inv[a] = a^(p-2) mod p for every residue (inv[0] = 0), by square-and-multiply over the whole table."""
    global _inverse
    if _inverse is None:
        base = torch.arange(PRIME, dtype=torch.int64)
        result = torch.ones(PRIME, dtype=torch.int64)
        e = PRIME - 2
        while e:
            if e & 1:
                result = result * base % PRIME
            base = base * base % PRIME
            e >>= 1
        result[0] = 0
        _inverse = result
    return _inverse


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The values' 16 bits as unsigned integers (int64), as the reference reads bf16 and fp16 alike."""
    if values.dtype not in MANTISSA_BITS:
        raise ValueError(
            f"TOPLOC commits to bf16 or fp16 activations (torch.bfloat16, torch.float16), got {values.dtype}"
        )
    return values.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def injective_modulus(indices: torch.Tensor) -> int:
    """Largest m <= 65497 with ``indices % m`` all distinct (the reference searches downwards from 65497)."""
    k = indices.numel()
    if k and int(indices.max()) < PRIME and torch.unique(indices).numel() == k:
        return PRIME
    for m in range(PRIME, 0, -1):
        if torch.unique(indices % m).numel() == k:
            return m
    raise ValueError("no injective modulus found")


def interpolate(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Coefficients (ascending) of the polynomials through the points (x[b], y[b]) over GF(65497).

    ``x`` and ``y`` are (B, k) int64, every row of ``x`` distinct mod p. Newton divided differences, then the
    Newton form expanded with a rolling product, exactly as the reference does it, but for B rows at once.
    """
    inv = _inverses()
    x = x % PRIME
    dd = y % PRIME
    k = x.shape[1]
    for j in range(1, k):
        num = (dd[:, j:] - dd[:, j - 1 : -1]) % PRIME
        den = (x[:, j:] - x[:, :-j]) % PRIME
        dd[:, j:] = num * inv[den] % PRIME
    coeffs = torch.zeros_like(dd)
    factor = torch.zeros_like(dd)
    factor[:, 0] = 1
    zero = torch.zeros((x.shape[0], 1), dtype=torch.int64)
    for i in range(k):
        coeffs = (coeffs + dd[:, i : i + 1] * factor) % PRIME
        if i + 1 < k:
            shifted = torch.cat([zero, factor[:, :-1]], dim=1)
            factor = (shifted + factor * ((-x[:, i : i + 1]) % PRIME)) % PRIME
    return coeffs


def evaluate(coeffs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Horner evaluation of (B, n) coefficient rows at (B, k) points, mod p."""
    x = x % PRIME
    result = coeffs[:, -1:].expand_as(x).clone()
    for i in range(coeffs.shape[1] - 2, -1, -1):
        result = (result * x + coeffs[:, i : i + 1]) % PRIME
    return result


def encode(modulus: int, coeffs: torch.Tensor) -> bytes:
    out = torch.empty(1 + coeffs.numel(), dtype=torch.int64)
    out[0] = modulus
    out[1:] = coeffs
    hi = (out >> 8) & 0xFF
    lo = out & 0xFF
    return bytes(torch.stack([hi, lo], dim=1).to(torch.uint8).flatten().tolist())


def decode(data: bytes) -> tuple[int, list[int]]:
    """(modulus, coefficients), as the reference reads them (a trailing odd byte is ignored)."""
    if len(data) < 2:
        raise ValueError("proof shorter than 2 bytes")
    coeffs = [(data[i] << 8) | data[i + 1] for i in range(2, len(data) - 1, 2)]
    return (data[0] << 8) | data[1], coeffs


def chunk_activations(
    activations: list[torch.Tensor], decode_batching_size: int = DECODE_BATCH, skip_prefill: bool = False
) -> list[torch.Tensor]:
    """The flat chunks proofs are built over: the prefill alone, then runs of ``decode_batching_size`` steps."""
    chunks = []
    start = 0
    if not skip_prefill:
        chunks.append(activations[0].reshape(-1))
        start = 1
    for i in range(start, len(activations), decode_batching_size):
        chunks.append(torch.cat([a.reshape(-1) for a in activations[i : i + decode_batching_size]]))
    return chunks


def _top(chunk: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    if chunk.numel() < topk:
        raise ValueError(f"a chunk of {chunk.numel()} values has fewer than topk={topk}")
    indices = chunk.abs().topk(topk).indices
    return indices.cpu(), chunk[indices].cpu()


def build_chunk_proofs(chunks: list[torch.Tensor], topk: int = TOPK) -> list[bytes]:
    """One proof per flat chunk; all interpolations in one batch."""
    if not chunks:
        return []
    xs, ys, moduli = [], [], []
    for chunk in chunks:
        indices, values = _top(chunk, topk)
        m = injective_modulus(indices)
        moduli.append(m)
        xs.append(indices % m)
        ys.append(_bits(values))
    coeffs = interpolate(torch.stack(xs), torch.stack(ys))
    return [encode(m, c) for m, c in zip(moduli, coeffs, strict=True)]


def build_proofs(
    activations: list[torch.Tensor],
    decode_batching_size: int = DECODE_BATCH,
    topk: int = TOPK,
    skip_prefill: bool = False,
) -> list[bytes]:
    """Same arguments and bytes as ``toploc.build_proofs_bytes``."""
    return build_chunk_proofs(chunk_activations(activations, decode_batching_size, skip_prefill), topk)


FOREIGN_SHARE = 0.125
"""Validators count a value whose mantissa differs by more than this share of the mantissa's range (16 bf16 units,
128 fp16 units: 6-12% of the value) as a mismatch, as one whose exponent differs. Such a value is not rounding:
where the chunk's k-th and (k+1)-th magnitudes are within rounding of each other, the validator's top-k holds an
index the producer never committed to, and the proof's polynomial gives a random 16-bit value there. Mostly its
exponent differs (one mismatch, allowed); one time in about 256 the exponent matches, and its random mantissa,
averaged with 63 exact ones, made a mean error of 0.59 that banned an honest fp32 producer (0 mismatches, median 0).
Only values near the boundary can be foreign (``FOREIGN_WINDOW``): a large error elsewhere stays in the mean."""

FOREIGN_WINDOW = 0.25
"""A value counts as foreign (``FOREIGN_SHARE``) only if its magnitude is within this share above the validator's
k-th largest: an index the producer never committed to is one whose magnitude ties the k-th within rounding (bf16
rounding between two honest passes moves a value by a few percent). Without the window a producer could move up to
``max_exp_mismatches`` of its largest values by up to half their mantissa range and keep them out of the mean."""


def verify_chunk_proofs(
    chunks: list[torch.Tensor], proofs: list[bytes], topk: int = TOPK, foreign_share: float | None = None
) -> list[VerificationResult]:
    """Statistics for each (chunk, proof) pair; a proof that does not decode to ``topk`` coefficients fails.
    ``foreign_share`` (validators: ``FOREIGN_SHARE``) also counts as mismatches, out of the mantissa statistics, the
    values near the k-th magnitude (``FOREIGN_WINDOW``) whose mantissa differs by more than that share of its range;
    None gives the reference's statistics."""
    if len(chunks) != len(proofs):
        raise ValueError(f"{len(proofs)} proofs for {len(chunks)} chunks")
    if not chunks:
        return []
    failed = VerificationResult(topk, NO_MATCH, NO_MATCH)
    rows, xs, vals, widths, where = [], [], [], [], []
    near: list[torch.Tensor] = []  # per row: values close enough to the k-th magnitude to be foreign
    for i, (chunk, proof) in enumerate(zip(chunks, proofs, strict=True)):
        if len(proof) != proof_bytes(topk):
            continue
        m, coeffs = decode(proof)
        if not 1 <= m <= PRIME:
            continue
        indices, values = _top(chunk, topk)
        rows.append(coeffs)
        xs.append(indices % m)
        vals.append(_bits(values))
        magnitudes = values.float().abs()
        near.append(magnitudes <= magnitudes.min() * (1.0 + FOREIGN_WINDOW))
        widths.append(MANTISSA_BITS[values.dtype])
        where.append(i)
    results = [failed] * len(chunks)
    if not rows:
        return results
    claimed = evaluate(torch.tensor(rows, dtype=torch.int64), torch.stack(xs))
    own = torch.stack(vals)
    # each row's fields by its own dtype: bf16 exponent 0x7F80 / mantissa 0x7F, fp16 0x7C00 / 0x3FF (sign ignored)
    width = torch.tensor(widths, dtype=torch.int64).unsqueeze(1)
    mant_mask = (1 << width) - 1
    mismatch = ((claimed & 0x7FFF) >> width) != ((own & 0x7FFF) >> width)
    err = ((claimed & mant_mask) - (own & mant_mask)).abs()
    if foreign_share is not None:
        mismatch = mismatch | ((err > (foreign_share * (1 << width)).to(torch.int64)) & torch.stack(near))
    for row, i in enumerate(where):
        errs = err[row][~mismatch[row]]
        n_mis = int(mismatch[row].sum())
        if errs.numel() == 0:
            results[i] = VerificationResult(n_mis, NO_MATCH, NO_MATCH)
            continue
        ordered = errs.sort().values
        results[i] = VerificationResult(n_mis, float(errs.double().mean()), float(ordered[errs.numel() // 2]))
    return results


def verify_proofs(
    activations: list[torch.Tensor],
    proofs: list[bytes],
    decode_batching_size: int = DECODE_BATCH,
    topk: int = TOPK,
    skip_prefill: bool = False,
) -> list[VerificationResult]:
    """Same statistics as ``toploc.verify_proofs_bytes`` on a (rows, hidden) tensor (its C++ path) for bf16;
    fp16 activations are split at the fp16 field boundaries (the reference refuses them)."""
    return verify_chunk_proofs(chunk_activations(activations, decode_batching_size, skip_prefill), proofs, topk)
