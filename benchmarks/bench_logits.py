"""Per-token log-probs from LM logits, forward + backward: hybridflow's fused chunks vs plain autograd.

``engine/logits.py`` computes log p(next token) (and the entropy) in one autograd function over
cache-sized chunks; this times it against the same math under plain autograd, once per 2048-token
chunk (what the engine did before) and on the whole matrix, on random fp32 logits of an RL-sized
micro-batch (default: 3,800 response tokens x SmolLM2's 49,152-entry vocabulary). Each variant runs
``--repeats`` times on fresh leaves; the best forward + backward is printed, with the load average.

    python benchmarks/bench_logits.py
    python benchmarks/bench_logits.py --tokens 1920 --vocab 151936 --entropy
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from hybridflow.device import configure_host_allocator
from hybridflow.engine.logits import _chunk_outputs, token_logprobs_and_entropy


def plain_chunks(logits_NV, ids_N, want_entropy, rows=2048):
    parts = [_chunk_outputs(logits_NV[s:s + rows], ids_N[s:s + rows], want_entropy) for s in range(0, len(ids_N), rows)]
    logprobs_N = torch.cat([lp for lp, _ in parts])
    return logprobs_N, (torch.cat([ent for _, ent in parts]) if want_entropy else None)


def whole_matrix(logits_NV, ids_N, want_entropy):
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1) if want_entropy else None
    return logp_NV.gather(-1, ids_N[:, None])[:, 0], entropy_N


def fused(logits_NV, ids_N, want_entropy):
    return token_logprobs_and_entropy(logits_NV, ids_N, want_entropy=want_entropy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=3800)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--entropy", action="store_true", help="also compute the entropy and back-propagate it")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    configure_host_allocator()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    logits_NV = torch.randn(args.tokens, args.vocab, generator=generator) * 3
    ids_N = torch.randint(0, args.vocab, (args.tokens,), generator=generator)
    print(f"{args.tokens} tokens x {args.vocab} vocabulary, fp32, {args.threads} threads, entropy={args.entropy}, "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, fn in [("fused (hybridflow)", fused), ("autograd per 2048 tokens", plain_chunks),
                     ("autograd whole matrix", whole_matrix)]:
        best = None
        for _ in range(args.repeats):
            leaf = logits_NV.clone().requires_grad_(True)
            start = time.perf_counter()
            logprobs_N, entropy_N = fn(leaf, ids_N, args.entropy)
            middle = time.perf_counter()
            loss = logprobs_N.sum() + (entropy_N.sum() if entropy_N is not None else 0.0)
            loss.backward()
            end = time.perf_counter()
            if best is None or end - start < best[0] + best[1]:
                best = (middle - start, end - middle)
        print(f"{name:26s} forward {best[0]:.3f} s  backward {best[1]:.3f} s  total {sum(best):.3f} s", flush=True)


if __name__ == "__main__":
    main()
