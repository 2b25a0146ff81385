"""Cost of TOPLOC: proof building against decode time, validation beyond the prefill, and ours against the
reference ``toploc`` 0.1.6 on the same activations (SmolLM2-135M-Instruct, bf16, this CPU).

    python benchmarks/toploc_speed.py [--model smollm2|tiny] [--rows 32] [--new-tokens 64]

- build overhead: the proofs of a generation batch (``--rows`` rows, ``--new-tokens`` tokens each) are built
  from the hidden states kept during decoding; their cost (one batched interpolation) as a percentage of the
  decode time of the same batch without proofs. End-to-end times with and without proofs are shown too.
- validation per 1,000-token rollout: one prefill over prompt + 1,000 completion tokens, then TOPLOC verification
  of its 33 proofs and the re-derivation of all 1,000 tokens (Gumbel noise over the vocabulary); reported is the
  time beyond the prefill.
- against the reference: the same proofs built and verified by ``toploc`` (its C++ extension; install it with
  ``pip install --no-build-isolation --no-binary toploc toploc==0.1.6``), for one generation batch and for
  a single rollout. Ratios are reference time / our time (above 1: ours is faster). Bytes are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from intellect_kernels import toploc
from intellect_kernels.sampling import position_keys, sampling_gaps
from intellect_node.policy.generate import HiddenCapture, ProofSettings, sample_groups

from harness.models import load


def best_of(n: int, fn: Callable[[], Any]) -> float:
    """Median seconds of ``n`` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compute", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args()
    try:
        import toploc as reference
    except ImportError:
        reference = None
    model, tok = load(args.model, args.compute)
    pad = int(tok.pad_token_id)
    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    prompts = [torch.randint(min(100, vocab // 2), vocab, (12,), generator=g).tolist() for _ in range(args.rows)]
    seeds = list(range(args.rows))
    never = -1  # no EOS: every row decodes all --new-tokens

    def generate(proofs: ProofSettings | None) -> Any:
        return sample_groups(model, prompts, 1, args.new_tokens, 1.0, never, pad, seeds, proofs=proofs)

    decode_s = best_of(args.repeats, lambda: generate(None))
    with_proofs_s = best_of(args.repeats, lambda: generate(ProofSettings()))
    # the hidden states the generation keeps, as the proof builder gets them
    with HiddenCapture(model) as capture:
        sample_groups(model, prompts, 1, args.new_tokens, 1.0, never, pad, seeds)
        outs = list(capture.outputs)
    prefill, steps = outs[0], torch.stack([o[:, -1, :] for o in outs[1:]], dim=1)
    per_row = [[prefill[i]] + list(steps[i].unsqueeze(1)) for i in range(args.rows)]
    chunks = [c for acts in per_row for c in toploc.chunk_activations(acts)]
    build_s = best_of(args.repeats, lambda: toploc.build_chunk_proofs(chunks))
    ours = toploc.build_chunk_proofs(chunks)
    rows: list[tuple[str, str]] = [
        ("model", f"{args.model} ({model.dtype}), {args.rows} rows x {args.new_tokens} new tokens"),
        ("decode, no proofs", f"{decode_s * 1e3:.0f} ms"),
        ("decode with proofs (end to end)", f"{with_proofs_s * 1e3:.0f} ms"),
        (f"build {len(chunks)} proofs (one batch)", f"{build_s * 1e3:.1f} ms"),
    ]
    build_overhead = 100 * build_s / decode_s

    # validation of one 1,000-token rollout beyond its prefill
    n = 1000
    seq = torch.randint(min(100, vocab // 2), vocab, (1, 12 + n), generator=g)
    with HiddenCapture(model) as capture:
        prefill_s = best_of(args.repeats, lambda: model(input_ids=seq))
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0]
        hidden = capture.take()[0]
    acts = [hidden[:12]] + list(hidden[12 : 12 + n - 1].unsqueeze(1))
    v_chunks = toploc.chunk_activations(acts)
    v_proofs = toploc.build_chunk_proofs(v_chunks)
    keys = position_keys([7] * n, list(range(n)))
    tokens = seq[0, 12:]
    verify_s = best_of(args.repeats, lambda: toploc.verify_chunk_proofs(v_chunks, v_proofs))
    sampling_s = best_of(args.repeats, lambda: sampling_gaps(logits[11 : 11 + n], 1.0, keys, tokens))
    rows += [
        ("prefill of a 1,012-token sequence", f"{prefill_s * 1e3:.0f} ms"),
        (f"verify its {len(v_chunks)} proofs", f"{verify_s * 1e3:.1f} ms"),
        ("re-derive its 1,000 tokens", f"{sampling_s * 1e3:.1f} ms"),
    ]
    verify_ms = (verify_s + sampling_s) * 1e3

    build_ratio = verify_ratio = float("nan")
    if reference is not None:
        theirs = [x for acts in per_row for x in reference.build_proofs_bytes(acts, 32, 128)]
        assert theirs == ours, "proof bytes differ from the reference"
        ref_build_s = best_of(args.repeats, lambda: [reference.build_proofs_bytes(a, 32, 128) for a in per_row])
        build_ratio = ref_build_s / build_s
        one = per_row[0]
        one_ours = best_of(args.repeats, lambda: toploc.build_proofs(one))
        one_ref = best_of(args.repeats, lambda: reference.build_proofs_bytes(one, 32, 128))
        decode_rows = torch.cat(acts[1:])
        decode_proofs = toploc.build_proofs(acts[1:], skip_prefill=True)
        ours_v = best_of(args.repeats, lambda: toploc.verify_proofs(acts[1:], decode_proofs, skip_prefill=True))
        ref_v = best_of(
            args.repeats, lambda: reference.verify_proofs_bytes(decode_rows, decode_proofs, 32, 128, skip_prefill=True)
        )
        verify_ratio = ref_v / ours_v
        rows += [
            (f"reference: build the batch's {len(chunks)} proofs", f"{ref_build_s * 1e3:.1f} ms (x{build_ratio:.2f})"),
            ("one rollout's proofs: ours / reference", f"{one_ours * 1e3:.2f} / {one_ref * 1e3:.2f} ms"),
            (
                f"verify {len(decode_proofs)} decode proofs: ours / reference",
                f"{ours_v * 1e3:.1f} / {ref_v * 1e3:.1f} ms",
            ),
        ]
    else:
        rows.append(("reference toploc", "not installed: ratios are nan"))
    print(f"\nTOPLOC cost on this CPU ({torch.get_num_threads()} threads)")
    for name, value in rows:
        print(f"  {name:52} {value}")
    print(
        f"toploc_speed build_overhead_pct={build_overhead:.2f} verify_ms_per_1k_tokens={verify_ms:.1f} "
        f"build_vs_reference={build_ratio:.2f} verify_vs_reference={verify_ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
