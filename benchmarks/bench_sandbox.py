"""Per-call cost of the code sandbox: median wall time of run_python("pass") with and without bubblewrap.

Run: PYTHONPATH=. python -W ignore benchmarks/bench_sandbox.py [--calls 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from collections.abc import Callable

from hybridflow.rewards.sandbox import SandboxConfig, run_python


def median_seconds(call: Callable[[], object], calls: int) -> float:
    durations = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        durations.append(time.perf_counter() - start)
    return statistics.median(durations)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20, help="calls per measurement (the median is reported)")
    calls = parser.parse_args().calls
    config = SandboxConfig()
    run_python("pass")  # the one-time probe of bubblewrap is not part of a call's cost
    bare = median_seconds(lambda: subprocess.run([config.interpreter, "-I", "-B", "-c", "pass"], check=True), calls)
    unisolated = median_seconds(lambda: run_python("pass", config=SandboxConfig(isolation="none")), calls)
    isolated = median_seconds(lambda: run_python("pass"), calls)
    print(f"bare interpreter start {bare * 1000:.0f} ms; run_python isolation=none {unisolated * 1000:.0f} ms; "
          f"run_python bwrap {isolated * 1000:.0f} ms; sandbox overhead {(isolated - unisolated) * 1000:.0f} ms/call")


if __name__ == "__main__":
    main()
