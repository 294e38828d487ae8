"""Two GRPO steps of examples/smollm2_gsm8k/run.py in local mode: the run the SmolLM2 end-to-end tests share."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from hybridflow.models import smollm2_path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "smollm2_gsm8k"


def load_example(directory: Path):
    """``directory/run.py`` imported under a name of its own (two examples' ``run`` modules never shadow each
    other in one test session); skips the calling test when the converted checkpoint or reasoning-gym (the
    examples' prompts) is absent."""
    if smollm2_path() is None:
        pytest.skip("SmolLM2-135M-Instruct not converted (run scripts/get_smollm2.py)")
    if importlib.util.find_spec("reasoning_gym") is None:
        pytest.skip("reasoning-gym not installed (pip install 'hybridflow[math]')")
    name = f"hybridflow_example_{directory.name}"
    if name not in sys.modules:
        sys.path.insert(0, str(directory))  # the example's own imports (modules beside run.py)
        try:
            spec = importlib.util.spec_from_file_location(name, directory / "run.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(directory))
    return sys.modules[name]


def run_two_grpo_steps(output_dir: Path, *, max_new_tokens: int, overrides: Sequence[str] = (),
                       **run_options) -> list[dict]:
    """The example's ``run`` for 2 steps of 2 prompts x 2 samples (one mini-batch), no validation or checkpoints,
    every role in this process; ``run_options`` go to ``run`` (``num_train``, ``num_eval``, ``problems``).

    Skips the calling test when the converted checkpoint or reasoning-gym (the example's prompts) is absent.
    """
    example = load_example(EXAMPLE)
    return example.run([f"trainer.output_dir={output_dir}", "trainer.total_steps=2", "trainer.val_every=0",
                        "trainer.save_every=0", "trainer.progress_bar=false", "batch.prompts_per_step=2",
                        "batch.samples_per_prompt=2", "batch.mini_batch_size=4",
                        f"actor.generation.max_new_tokens={max_new_tokens}", *overrides], mode="local", **run_options)
