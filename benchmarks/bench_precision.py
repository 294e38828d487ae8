"""bf16 against fp32 on this machine: matmul speed, the attention kernels, and the log-prob error bf16 brings.

What `dtype: auto` rests on (hybridflow/device.py, ``default_dtype``): on a CPU with bf16 instructions
(AVX512-BF16 or AMX) bf16 matmuls are 2-3x fp32's; its SDPA kernel is not (so the training path runs attention
in fp32 and the decoder uses grouped matmuls, ``--attention``); and the log-probs it gives differ from fp32's
by the amounts ``--logprobs`` prints.

    python benchmarks/bench_precision.py                  # all three, 2 threads
    python benchmarks/bench_precision.py --logprobs --model smollm2
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from hybridflow.device import cpu_has_native_bf16, current_device


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmuls(repeats: int) -> None:
    """GFLOP/s of x @ W^T in fp32 and bf16 on shapes of SmolLM2 (hidden 576) and the small model (hidden 256)."""
    print(f"matmul GFLOP/s, fp32 / bf16 (CPU has bf16 instructions: {cpu_has_native_bf16()})")
    device = current_device()
    for rows, inner, outer, what in [(1024, 1024, 1024, "1024^3"), (4096, 576, 1536, "SmolLM2 gate, 4096 tokens"),
                                     (4096, 1536, 576, "SmolLM2 down, 4096 tokens"),
                                     (32, 576, 1536, "SmolLM2 gate, decode batch 32"),
                                     (32, 576, 49152, "SmolLM2 head, decode batch 32"),
                                     (4864, 256, 768, "small model MLP, 4864 tokens"),
                                     (4864, 64, 128, "tiny model MLP, 4864 tokens")]:
        rates = []
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, inner, device=device, dtype=dtype)
            w = torch.randn(outer, inner, device=device, dtype=dtype)
            rates.append(2 * rows * inner * outer / best_seconds(lambda: F.linear(x, w), repeats) / 1e9)
        print(f"  {what:32s} {rates[0]:7.1f} / {rates[1]:7.1f}  ({rates[1] / rates[0]:.2f}x)")


def attention_kernels(repeats: int) -> None:
    """ms of the attention the trainer and the decoder run, in fp32 and bf16, SDPA and the paths used instead."""
    from hybridflow.engine.decoder import attention
    from hybridflow.models.packed_attention import causal_matmul_attention

    device = current_device()
    print("packed training attention, forward + backward, ms (sequences x heads x tokens x head dim)")
    for shape in ((128, 8, 38, 32), (32, 9, 128, 64), (16, 9, 256, 64)):
        cells = []
        for label, dtype, how in [("fp32 SDPA", torch.float32, "sdpa"), ("bf16 SDPA", torch.bfloat16, "sdpa"),
                                  ("bf16 in, SDPA in fp32", torch.bfloat16, "upcast"),
                                  ("bf16 matmuls", torch.bfloat16, "matmuls")]:
            q, k, v = (torch.randn(*shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

            def step():
                if how == "matmuls":
                    out = causal_matmul_attention(q, k, v, None)
                elif how == "upcast":
                    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(dtype)
                else:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.float().sum().backward()
            cells.append(f"{label} {best_seconds(step, repeats) * 1e3:.1f}")
        print(f"  {' x '.join(map(str, shape)):16s} " + ", ".join(cells))
    print("decode attention per layer, ms (batch 32, 9 query / 3 key-value heads, head dim 64)")
    for length in (96, 288):
        cells = []
        for label, dtype, fn in [("fp32 SDPA", torch.float32, None), ("bf16 SDPA", torch.bfloat16, None),
                                 ("bf16 grouped matmuls", torch.bfloat16, attention)]:
            q = torch.randn(32, 9, 1, 64, device=device, dtype=dtype)
            k, v = (torch.randn(32, 3, length, 64, device=device, dtype=dtype) for _ in range(2))
            mask = torch.ones(32, 1, 1, length, dtype=torch.bool, device=device)
            run = (lambda: fn(q, k, v, mask, 0.125)) if fn else \
                (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True))
            cells.append(f"{label} {best_seconds(run, repeats) * 1e3:.3f}")
        print(f"  {length:3d} cached positions: " + ", ".join(cells))


def logprob_error(model_name: str, rows: int, length: int) -> None:
    """|log p - log p_fp32| of sampled tokens, against the fp32 training forward: the training forward under
    bf16 autocast (what `dtype: auto` trains with on a bf16 CPU), and the bf16 rollout's own log-probs."""
    from bench_generation import load

    from hybridflow.engine.decoder import DecoderStage
    from hybridflow.engine.generation import GenerationEngine, SamplingConfig

    model = load("tiny" if model_name == "small" else model_name, current_device())
    prompts = torch.randint(3, 1000, (rows, 8), generator=torch.Generator().manual_seed(0))
    bf16_state = {name: tensor.bfloat16() for name, tensor in model.state_dict().items()}
    rollout = GenerationEngine(DecoderStage.from_state_dict(model.config, bf16_state)).generate(
        prompts, torch.ones_like(prompts), SamplingConfig(max_new_tokens=length, seed=0))
    ids, valid = rollout["input_ids"], rollout["response_mask"].bool()
    targets = ids[:, 8:]

    def forward_logprobs(autocast: bool) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids).logits[:, 7:-1].float()
        return logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]

    fp32 = forward_logprobs(False)
    for label, logprobs in (("training forward under bf16 autocast", forward_logprobs(True)),
                            ("bf16 rollout's own log-probs", rollout["logprobs"])):
        diff = (logprobs - fp32).masked_fill(~valid, 0.0)
        print(f"{label} against fp32 ({model_name}, {int(valid.sum())} sampled tokens): |diff| mean "
              f"{diff.abs()[valid].mean():.4f}, p99 {diff.abs()[valid].quantile(0.99):.4f}, max "
              f"{diff.abs().max():.4f}; sequence log-prob: mean |diff| {diff.sum(1).abs().mean():.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matmul", action="store_true")
    parser.add_argument("--attention", action="store_true")
    parser.add_argument("--logprobs", action="store_true")
    parser.add_argument("--model", default="small", choices=("small", "smollm2"),
                        help="small: bench_generation's 256-wide 4-layer Llama (random init)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    everything = not (args.matmul or args.attention or args.logprobs)
    print(f"threads={args.threads} load average {os.getloadavg()[0]:.1f}")
    if args.matmul or everything:
        matmuls(args.repeats)
    if args.attention or everything:
        attention_kernels(args.repeats)
    if args.logprobs or everything:
        logprob_error(args.model, rows=32, length=32)


if __name__ == "__main__":
    main()
