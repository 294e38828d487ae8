"""Attention over one packed micro-batch, three ways, forward + backward: `python benchmarks/bench_attention_kernels.py`.

dense_mask: SDPA with the [N, N] block-diagonal causal mask (the old path); packed_sdpa: sequences
gathered into a right-padded batch, causal SDPA, scattered back (hybridflow's default);
per_seq_loop: one causal SDPA call per sequence. Shapes: the small model (8 heads x 32) and
SmolLM2-135M (9 heads x 64, its 3 key/value heads expanded); sequences of 14-52 tokens.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from hybridflow.models.packed_attention import packed_sdpa_attention, packed_segments


def sequence_lengths(budget: int, generator: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(14, 53, (budget // 14,), generator=generator)
    return lengths[: int((lengths.cumsum(0) <= budget).sum())]


def dense_mask(q, k, v, positions):
    starts = torch.ones_like(positions[0], dtype=torch.bool)
    starts[1:] = positions[0, 1:] != positions[0, :-1] + 1
    segment = torch.cumsum(starts.long(), 0)
    index = torch.arange(segment.numel())
    allowed = (segment[:, None] == segment[None]) & (index[None] <= index[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, None])


def packed(q, k, v, positions):
    return packed_sdpa_attention(None, q, k, v, None, packed_segments=packed_segments(positions))[0]


def per_sequence(q, k, v, positions):
    cu = packed_segments(positions).cu_seqlens.tolist()
    return torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
                      for a, b in zip(cu[:-1], cu[1:])], dim=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average {os.getloadavg()[0]:.2f}, threads {args.threads}")
    generator = torch.Generator().manual_seed(0)
    for heads, head_dim in ((8, 32), (9, 64)):
        for budget in (512, 4096):
            lengths = sequence_lengths(budget, generator)
            positions = torch.cat([torch.arange(int(n)) for n in lengths])[None]
            tokens = positions.shape[1]
            for name, fn in (("dense_mask", dense_mask), ("packed_sdpa", packed), ("per_seq_loop", per_sequence)):
                q, k, v = (torch.randn(1, heads, tokens, head_dim, requires_grad=True) for _ in range(3))
                fn(q, k, v, positions).sum().backward()
                start = time.perf_counter()
                for _ in range(args.repeats):
                    fn(q, k, v, positions).sum().backward()
                seconds = (time.perf_counter() - start) / args.repeats
                print(f"heads={heads} dim={head_dim} budget={budget} tokens={tokens} seqs={len(lengths):3d} "
                      f"{name:12s} fwd+bwd={seconds * 1e3:8.2f} ms", flush=True)


if __name__ == "__main__":
    main()
