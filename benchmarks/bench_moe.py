"""A mixture-of-experts layer, forward + backward: hybridflow's grouped experts against a per-expert loop.

Legend: T tokens, H hidden size, I expert intermediate size, E experts, K experts per token.

Both compute the same sum over each token's top-k experts from the same stacked weights (gate_up [E, 2I, H],
down [E, H, I]): ``grouped`` is ``hybridflow.models.moe.grouped_experts`` (the assignments sorted by expert into
an [E, C, H] batch, two batched matmuls); ``loop`` is transformers' eager Qwen3-MoE experts forward (a Python loop
over the experts hit, two matmuls and an index_add per expert). The routing is drawn once from a random router.

    python benchmarks/bench_moe.py                     # T=2048 H=256 I=128 E=32 K=4, fp32, 5 repeats
    python benchmarks/bench_moe.py --tokens 512 --experts 128 --top-k 8
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from hybridflow.models.moe import grouped_experts, route


def per_expert_loop(hidden_TH, experts_TK, weights_TK, gate_up_E2IH, down_EHI, activation):
    """transformers' eager experts forward (Qwen3MoeExperts.forward), on the same tensors."""
    out_TH = torch.zeros_like(hidden_TH)
    num_experts = gate_up_E2IH.shape[0]
    expert_mask_EKT = F.one_hot(experts_TK, num_classes=num_experts).permute(2, 1, 0)
    for expert in (expert_mask_EKT.sum(dim=(-1, -2)) > 0).nonzero()[:, 0].tolist():
        slot_A, token_A = torch.where(expert_mask_EKT[expert])
        gate_AI, up_AI = F.linear(hidden_TH[token_A], gate_up_E2IH[expert]).chunk(2, dim=-1)
        expert_AH = F.linear(activation(gate_AI) * up_AI, down_EHI[expert]) * weights_TK[token_A, slot_A, None]
        out_TH = out_TH.index_add(0, token_A, expert_AH)
    return out_TH


def time_forward_backward(fn, inputs, repeats: int) -> float:
    """Median seconds of one forward + backward (after one warm-up)."""
    hidden_TH, experts_TK, weights_TK, gate_up, down = inputs
    times = []
    for _ in range(repeats + 1):
        for tensor in (hidden_TH, gate_up, down):
            tensor.grad = None
        start = time.perf_counter()
        fn(hidden_TH, experts_TK, weights_TK, gate_up, down, F.silu).square().sum().backward()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    hidden_TH = torch.randn(args.tokens, args.hidden, requires_grad=True)
    gate_up = (torch.randn(args.experts, 2 * args.intermediate, args.hidden) * 0.05).requires_grad_(True)
    down = (torch.randn(args.experts, args.hidden, args.intermediate) * 0.05).requires_grad_(True)
    router_EH = torch.randn(args.experts, args.hidden)
    with torch.no_grad():
        _, weights_TK, experts_TK = route(hidden_TH, router_EH, args.top_k, True)
    inputs = (hidden_TH, experts_TK, weights_TK, gate_up, down)
    with torch.no_grad():
        difference = (grouped_experts(*inputs, F.silu) - per_expert_loop(*inputs, F.silu)).abs().max().item()
    grouped = time_forward_backward(grouped_experts, inputs, args.repeats)
    loop = time_forward_backward(per_expert_loop, inputs, args.repeats)
    print(f"T={args.tokens} H={args.hidden} I={args.intermediate} E={args.experts} K={args.top_k} fp32, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"grouped experts: {grouped * 1e3:.1f} ms forward+backward")
    print(f"per-expert loop: {loop * 1e3:.1f} ms forward+backward ({loop / grouped:.2f}x the grouped time)")
    print(f"max |grouped - loop| of the outputs: {difference:.2e}")


if __name__ == "__main__":
    main()
