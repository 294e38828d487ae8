"""Single-process model numbers: load time, forward and forward+backward tokens/s, greedy decode tokens/s.

    python benchmarks/bench_models.py [--threads 2] [--batch 4] [--seq 128] [--new-tokens 32]

Runs on the tiny Llama and, when converted (scripts/get_smollm2.py), SmolLM2-135M-Instruct, in fp32 on
CPU (bf16 on a CUDA device via ModelConfig(dtype="auto")). Each timing is the median of 3 runs after one
warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from hybridflow.device import current_device  # noqa: E402
from hybridflow.models import ModelConfig, build_model, smollm2_path  # noqa: E402


def _median_seconds(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(name: str, config: ModelConfig, *, batch: int, seq: int, new_tokens: int) -> None:
    device = current_device(0)
    start = time.perf_counter()
    model = build_model(config, device=device)
    load_s = time.perf_counter() - start
    vocab_size = model.config.vocab_size
    input_ids_BS = torch.randint(3, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    num_params = sum(param.numel() for param in model.parameters())

    def forward():
        with torch.no_grad():
            model(input_ids=input_ids_BS)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        model(input_ids=input_ids_BS, labels=input_ids_BS).loss.backward()

    def decode():
        model.generate(input_ids=input_ids_BS[:1, :16], attention_mask=torch.ones_like(input_ids_BS[:1, :16]),
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    forward_s = _median_seconds(forward)
    model.train()
    train_s = _median_seconds(forward_backward)
    model.eval()
    decode_s = _median_seconds(decode)
    tokens = batch * seq
    print(f"{name}: params {num_params / 1e6:.1f} M, load {load_s:.2f} s | forward [{batch}x{seq}] "
          f"{tokens / forward_s:,.0f} tok/s | forward+backward {tokens / train_s:,.0f} tok/s | "
          f"greedy decode (batch 1, {new_tokens} new) {new_tokens / decode_s:,.1f} tok/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = dict(batch=args.batch, seq=args.seq, new_tokens=args.new_tokens)
    bench("tiny llama", ModelConfig(tiny={}), **shape)
    path = smollm2_path()
    if path is None:
        print("SmolLM2-135M-Instruct not converted: run `python scripts/get_smollm2.py` to include it")
    else:
        bench("SmolLM2-135M", ModelConfig(path=path), **shape)


if __name__ == "__main__":
    main()
