"""Plot a run's training reward and held-out accuracy per step.

    python examples/smollm2_arithmetic/plot.py RUN_DIR [OUT.png]      # default OUT: RUN_DIR/curve.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(run_dir: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["reward/score_mean"]) for r in records if "reward/score_mean" in r]
    held_out = [(r["step"], r["val/score_mean"]) for r in records if "val/score_mean" in r]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(*zip(*train), ".-", label="training reward (mean of 16 x 8 samples)")
    if held_out:
        axis.plot(*zip(*held_out), "o-", label="held-out accuracy (greedy)")
    axis.set_xlabel("GRPO step")
    axis.set_ylim(0, 1)
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    run = Path(sys.argv[1])
    print(plot(run, Path(sys.argv[2]) if len(sys.argv) > 2 else run / "curve.png"))
