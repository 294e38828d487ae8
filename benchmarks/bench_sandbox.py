"""Per-call cost of the code sandbox: median wall time of run_python("pass") with and without bubblewrap.

Run: PYTHONPATH=. python -W ignore benchmarks/bench_sandbox.py
"""

import statistics, subprocess, sys, time
from hybridflow.rewards.sandbox import run_python, SandboxConfig
cfg = SandboxConfig()
def timed(fn, n=20):
    xs = []
    for _ in range(n):
        t = time.perf_counter(); fn(); xs.append(time.perf_counter() - t)
    return statistics.median(xs)
run_python("pass")  # probe once
plain = timed(lambda: subprocess.run([cfg.interpreter, "-I", "-B", "-c", "pass"], check=True))
boxed = timed(lambda: run_python("pass"))
unboxed = timed(lambda: run_python("pass", config=SandboxConfig(isolation="none")))
print(f"plain interpreter start {plain*1000:.0f} ms; run_python isolation=none {unboxed*1000:.0f} ms; run_python bwrap {boxed*1000:.0f} ms; sandbox overhead {1000*(boxed-unboxed):.0f} ms/call")
