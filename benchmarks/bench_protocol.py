"""Benchmark of DataProto: serialization cost and size, row operations, and a Ray object-store round trip.

Usage: python benchmarks/bench_protocol.py [--rows 256] [--seq-len 2048] [--repeats 20] [--ray]
Prints one line per measurement: median milliseconds over --repeats runs and bytes where relevant.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import statistics
import time
from typing import Callable

import torch

from hybridflow.protocol import DataProto


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and lazy imports are not what we measure
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def build_batch(num_rows: int, seq_len: int) -> DataProto:
    """A rollout-shaped batch: ids and mask over the sequence, bf16 log-probs over half of it, prompt strings."""
    generator = torch.Generator().manual_seed(0)
    response_len = seq_len // 2
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.randint(0, 50_000, (num_rows, seq_len), generator=generator),
            "attention_mask": torch.ones(num_rows, seq_len, dtype=torch.int64),
            "old_logprobs": torch.randn(num_rows, response_len, generator=generator).to(torch.bfloat16),
        },
        non_tensors={"raw_prompt": [f"prompt number {i}" for i in range(num_rows)]},
        meta_info={"temperature": 1.0},
    )


def bench_pickle(data: DataProto, repeats: int) -> None:
    def out_of_band() -> int:
        buffers: list[pickle.PickleBuffer] = []
        payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
        pickle.loads(payload, buffers=buffers)
        return len(payload) + sum(buffer.raw().nbytes for buffer in buffers)

    def in_band() -> int:
        payload = pickle.dumps(data, protocol=5)
        pickle.loads(payload)
        return len(payload)

    def torch_save() -> int:
        # The usual alternative: a dict of tensors through torch.save/torch.load.
        stream = io.BytesIO()
        torch.save({k: data[k] for k in data.batch.keys()} | {"raw_prompt": list(data["raw_prompt"])}, stream)
        stream.seek(0)
        torch.load(stream, weights_only=False)
        return stream.getbuffer().nbytes

    tensor_bytes = sum(data[k].numel() * data[k].element_size() for k in data.batch.keys())
    print(f"tensor bytes: {tensor_bytes}")
    for name, fn in (("pickle protocol 5, out-of-band buffers", out_of_band),
                     ("pickle protocol 5, in-band", in_band),
                     ("torch.save/torch.load of a dict (baseline)", torch_save)):
        size = fn()
        print(f"{name}: dumps+loads {median_ms(fn, repeats):.2f} ms, payload {size} bytes "
              f"({size / tensor_bytes:.4f} x tensor bytes)")


def bench_rows(data: DataProto, repeats: int) -> None:
    def dispatch_collect() -> None:
        padded, pad_size = data.pad_to_multiple(3)
        DataProto.concat(padded.chunk(3)).unpad(pad_size)

    print(f"pad_to_multiple(3) + chunk(3) + concat + unpad: {median_ms(dispatch_collect, repeats):.2f} ms")
    print(f"chunk(8) (divisible, views): {median_ms(lambda: data.chunk(8), repeats):.3f} ms")
    print(f"repeat(4, interleave=True): {median_ms(lambda: data.repeat(4), repeats):.2f} ms")
    print(f"select(['input_ids']): {median_ms(lambda: data.select(['input_ids']), repeats):.3f} ms")
    print(f"data[1:3] (slice): {median_ms(lambda: data[1:3], repeats):.3f} ms")


def bench_ray(data: DataProto, repeats: int) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        print(f"ray.get(ray.put(data)): {median_ms(lambda: ray.get(ray.put(data)), repeats):.2f} ms")
        plain = {k: data[k] for k in data.batch.keys()} | {"raw_prompt": list(data["raw_prompt"])}
        plain_ms = median_ms(lambda: ray.get(ray.put(plain)), repeats)
        print(f"ray.get(ray.put(dict of tensors)) (baseline): {plain_ms:.2f} ms")
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--ray", action="store_true", help="also time a Ray object-store round trip")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = build_batch(args.rows, args.seq_len)
    print(f"batch: {data}")
    bench_pickle(data, args.repeats)
    bench_rows(data, args.repeats)
    if args.ray:
        bench_ray(data, args.repeats)


if __name__ == "__main__":
    main()
