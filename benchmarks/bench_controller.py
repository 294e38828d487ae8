"""Single-controller costs: driver overhead of one registered call, and moving a batch via futures vs the driver.

    python benchmarks/bench_controller.py [--calls 200] [--repeats 10] [--rows 256] [--tokens 2048]

Prints the median driver-side latency of a no-op call on an 8-rank group (ONE_TO_ALL and DP_PROTO)
and the time to move a rows x tokens batch (input_ids, attention_mask, position_ids: int64) from a
4-rank group to another 4-rank group, (a) chaining a future, (b) through the driver, with the
bytes the driver fetched in each case.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import ray  # noqa: E402
import torch  # noqa: E402

from hybridflow.controller import (  # noqa: E402
    ResourcePool,
    Worker,
    WorkerGroup,
    driver_fetch_stats,
    register,
    reset_driver_fetch_stats,
)
from hybridflow.protocol import DataProto  # noqa: E402


class BenchWorker(Worker):
    @register("ONE_TO_ALL")
    def noop(self) -> None:
        return None

    @register("DP_PROTO")
    def noop_dp(self, batch: DataProto) -> None:
        return None

    @register("DP_PROTO", blocking=False)
    def produce(self, prompts: DataProto, tokens: int) -> DataProto:
        ids_B = prompts["prompt_id"]
        input_ids_BS = ids_B[:, None] * tokens + torch.arange(tokens)[None, :]
        mask_BS = torch.ones_like(input_ids_BS)
        return DataProto.from_dict({"input_ids": input_ids_BS, "attention_mask": mask_BS,
                                    "position_ids": torch.arange(tokens).expand_as(input_ids_BS).clone()})

    @register("DP_METRICS")
    def consume(self, batch: DataProto) -> int:
        return int(batch["attention_mask"].sum())


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    ray.init(num_cpus=32, include_dashboard=False, log_to_driver=False)

    pool8 = ResourcePool([8], name="bench8")
    group8 = WorkerGroup(pool8, BenchWorker, name="bench8")
    for _ in range(10):
        group8.noop()
    tiny = DataProto.from_dict({"x": torch.zeros(8)})
    print(f"driver overhead, 8 ranks, ONE_TO_ALL no-op: median {median_ms(group8.noop, args.calls):.2f} ms "
          f"over {args.calls} calls")
    print(f"driver overhead, 8 ranks, DP_PROTO no-op (8-row batch): "
          f"median {median_ms(lambda: group8.noop_dp(tiny), args.calls):.2f} ms over {args.calls} calls")
    group8.shutdown()
    pool8.release()

    source = WorkerGroup(ResourcePool([4], name="bench-src"), BenchWorker, name="source")
    destination = WorkerGroup(ResourcePool([4], name="bench-dst"), BenchWorker, name="destination")
    prompts = DataProto.from_dict({"prompt_id": torch.arange(args.rows)})
    expected = args.rows * args.tokens

    def via_futures() -> None:
        assert sum(destination.consume(source.produce(prompts, args.tokens))) == expected

    def via_driver() -> None:
        batch = source.produce(prompts, args.tokens).get()
        assert sum(destination.consume(batch)) == expected

    def produce_and_consume_small() -> None:
        # the same two calls on a 4-row batch: the fixed cost both paths share
        small = DataProto.from_dict({"prompt_id": torch.arange(4)})
        destination.consume(source.produce(small, args.tokens))

    for fn in (via_futures, via_driver):
        fn()  # warm-up
    nbytes = 3 * args.rows * args.tokens * 8
    reset_driver_fetch_stats()
    futures_ms = median_ms(via_futures, args.repeats)
    futures_bytes = driver_fetch_stats().bytes / args.repeats
    reset_driver_fetch_stats()
    driver_ms = median_ms(via_driver, args.repeats)
    driver_bytes = driver_fetch_stats().bytes / args.repeats
    fixed_ms = median_ms(produce_and_consume_small, args.repeats)
    print(f"batch {args.rows} x {args.tokens} tokens ({nbytes / 2**20:.1f} MiB), 4 ranks -> 4 ranks, "
          f"median of {args.repeats}:")
    print(f"  via futures: {futures_ms:.1f} ms (driver fetched {futures_bytes / 2**20:.2f} MiB per move)")
    print(f"  via driver:  {driver_ms:.1f} ms (driver fetched {driver_bytes / 2**20:.2f} MiB per move)")
    print(f"  same two calls on a 4-row batch (fixed cost): {fixed_ms:.1f} ms")
    ray.shutdown()


if __name__ == "__main__":
    main()
