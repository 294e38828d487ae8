"""The coding example that learns: greedy episodes on the held-out coding tasks, GRPO with the coding environment
on the training tasks, and the held-out episodes again.

    python examples/agents/coding_learns.py runs/codesmol --model smollm2            # the run measured in docs
    python examples/agents/coding_learns.py runs/codeprobe --model smollm2 --grpo-steps 0  # held-out episodes only
    python examples/agents/coding_learns.py runs/codetiny --model tiny --grpo-steps 2 --num-train 4 ...  # a smoke run

Stages (on CPU, nothing downloaded):
1. the starting model: SmolLM2-135M-Instruct with ``--model smollm2`` (the converted checkpoint of
   ``scripts/get_smollm2.py``), any Hugging Face chat directory with ``--model DIR``, or the random tiny chat model
   of ``examples/episodes/make_chat_model.py`` (``tiny``: the short form the tests run; it learns nothing);
2. greedy episodes of the held-out tasks of ``coding_tasks.jsonl`` (``split: heldout``), run with ``transformers``
   through the episode runner's prompt and observation ids (``calculator_learns.evaluate``): ``pass_rate`` (the
   mean fraction of a task's tests passed, the reward), ``solved_rate`` (the share of tasks whose tests all pass),
   ``tool_call_rate`` (episodes that called the ``python`` tool) and ``turns_mean``;
3. GRPO with ``env.class: examples/agents/coding_env.py:CodingEnvironment`` on the training tasks (validation on
   the held-out ones every ``--val-every`` steps: ``val/score_mean`` is the greedy pass rate), no SFT: SmolLM2's
   sampled episodes already pass some tests, so GRPO's groups are not all tied;
4. the held-out episodes again; ``summary.json`` holds before, after, the per-step reward and the times.

A chat template that renders no ``tools=`` (SmolLM2's, ``template_renders_tools``) gets the ``python`` tool in its
system prompt (``PromptedCodingEnvironment``), in GRPO and in the evaluation alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import calculator_learns  # noqa: E402  (example files beside this one)
import coding_env  # noqa: E402
from calculator_smollm2 import template_renders_tools  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class CodingLearnsConfig:
    """Sizes of the run. The GRPO fields have ``calculator_learns.LearnsConfig``'s names, as its ``train_grpo``
    and ``base_model`` read them."""

    output_dir: str = "runs/codelearn"
    seed: int = 0
    model: str = "smollm2"
    """"smollm2" (SmolLM2-135M-Instruct), "tiny" (the random tiny chat model) or a Hugging Face directory."""
    hidden_size: int = 64
    """Width of the tiny model (``--model tiny`` only)."""
    num_train: int = 0
    """Training tasks used (the first ones of the train split); 0: all of them."""
    num_val: int = 0
    """Held-out tasks evaluated (the first ones of the held-out split); 0: all of them."""
    grpo_steps: int = 20
    """0: only the held-out episodes of the starting model (``after`` is then null)."""
    grpo_lr: float = 2e-5
    kl_mode: str = "none"
    """``algorithm.kl_mode`` of GRPO ("none" builds no reference model: a faster step)."""
    prompts_per_step: int = 4
    samples_per_prompt: int = 8
    val_every: int = 5
    max_new_tokens: int = 160
    """Per turn: SmolLM2's solutions of these tasks with an example after them take 60 to 150 tokens."""
    eval_samples: int = 4
    """Sampled held-out episodes per task (at ``eval_temperature``, the training's), beside the greedy ones: their
    pass rate and the paired per-task change before -> after with its standard error; 0: greedy only."""
    eval_temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.model not in calculator_learns.MODELS and not (Path(self.model) / "config.json").is_file():
            allowed = ", ".join(calculator_learns.MODELS)
            raise ValueError(f"model got {self.model!r}; allowed: {allowed} or a Hugging Face directory")
        for name in ("prompts_per_step", "samples_per_prompt", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} got {getattr(self, name)!r}; allowed: an integer >= 1")
        if self.eval_temperature <= 0:
            raise ValueError(f"eval_temperature got {self.eval_temperature!r}; allowed: a float > 0")
        for name in ("grpo_steps", "num_train", "num_val", "val_every", "eval_samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} got {getattr(self, name)!r}; allowed: an integer >= 0")


def environment_for(tokenizer) -> type:
    """``CodingEnvironment`` where the chat template renders ``tools=``, else ``PromptedCodingEnvironment``."""
    if template_renders_tools(tokenizer):
        return coding_env.CodingEnvironment
    return coding_env.PromptedCodingEnvironment


def split_rows(config: CodingLearnsConfig) -> tuple[list[dict], list[dict]]:
    """(training tasks, held-out tasks) of ``coding_tasks.jsonl``, cut to ``num_train`` and ``num_val``."""
    train, val = coding_env.task_rows("train"), coding_env.task_rows("heldout")
    return train[:config.num_train or None], val[:config.num_val or None]


def evaluate(model_dir: str | Path, rows: list[dict], *, max_new_tokens: int, environment: type, samples: int = 1,
             temperature: float | None = None) -> dict:
    """``calculator_learns.evaluate`` (greedy episodes through the runner's ids, or ``samples`` per task at
    ``temperature``) with the coding names, and the share of episodes whose tests all pass, which it does not
    count: a subclass of ``environment`` records each reward. ``task_pass_rates``: each task's mean over its
    episodes, in the order of ``rows``."""
    scores = []

    class Recorded(environment):
        def reward(self, row: dict, messages: list[dict]) -> float:
            scores.append(super().reward(row, messages))
            return scores[-1]

    measured = calculator_learns.evaluate(model_dir, rows, max_new_tokens=max_new_tokens,
                                          max_turns=environment.max_turns, environment=Recorded, samples=samples,
                                          temperature=temperature)
    return {"pass_rate": measured["accuracy"], "solved_rate": sum(score == 1.0 for score in scores) / len(scores),
            "tool_call_rate": measured["tool_call_rate"], "turns_mean": measured["turns_mean"],
            "task_pass_rates": measured["row_rewards"]}


def paired_change(before: list[float], after: list[float]) -> dict:
    """The per-task change of the pass rate, after - before over the same tasks: its mean, its standard error (the
    tasks' spread of changes / sqrt(tasks)) and how many tasks rose and fell."""
    import statistics

    if len(before) != len(after) or len(before) < 2:
        raise ValueError(f"paired_change needs two equal lists of >= 2 tasks, got {len(before)} and {len(after)}")
    changes = [late - early for early, late in zip(before, after)]
    return {"mean": statistics.mean(changes), "standard_error": statistics.stdev(changes) / len(changes) ** 0.5,
            "tasks": len(changes), "rose": sum(change > 0 for change in changes),
            "fell": sum(change < 0 for change in changes)}


def headline(numbers: dict | None) -> dict | None:
    """Held-out numbers without each task's pass rate (``summary.json`` keeps it), as the console shows them."""
    return None if numbers is None else {key: value for key, value in numbers.items() if key != "task_pass_rates"}


def run(config: CodingLearnsConfig) -> dict:
    """All stages; returns (and writes to ``output_dir/summary.json``) the before/after numbers and times."""
    from transformers import AutoTokenizer

    from hybridflow.data import write_jsonl

    root = Path(config.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    started, times = time.perf_counter(), {}
    base_dir = calculator_learns.base_model(config, root)
    environment = environment_for(AutoTokenizer.from_pretrained(str(base_dir)))
    train, val = split_rows(config)
    files = {"train": write_jsonl(root / "train.jsonl", train), "val": write_jsonl(root / "val.jsonl", val)}
    def held_out(model_dir: Path) -> tuple[dict, dict | None]:
        """(greedy, sampled) held-out numbers of ``model_dir``; sampled None with ``eval_samples`` 0."""
        greedy = evaluate(model_dir, val, max_new_tokens=config.max_new_tokens, environment=environment)
        sampled = None if not config.eval_samples else evaluate(
            model_dir, val, max_new_tokens=config.max_new_tokens, environment=environment,
            samples=config.eval_samples, temperature=config.eval_temperature)
        return greedy, sampled

    before, sampled_before = held_out(base_dir)
    times["eval_before_s"] = time.perf_counter() - started
    print(f"before GRPO ({len(val)} held-out tasks): greedy {headline(before)}; "
          f"sampled {headline(sampled_before)}", flush=True)
    history, after, sampled_after = [], None, None
    if config.grpo_steps:
        mark = time.perf_counter()
        history = calculator_learns.train_grpo(config, files, base_dir, root / "grpo",
                                               calculator_learns.environment_spec(environment))
        times["grpo_s"] = time.perf_counter() - mark
        mark = time.perf_counter()
        after, sampled_after = held_out(root / "grpo" / "final" / "actor")
        times["eval_after_s"] = time.perf_counter() - mark
        print(f"after GRPO ({config.grpo_steps} steps): greedy {headline(after)}; "
              f"sampled {headline(sampled_after)}", flush=True)
    times["total_s"] = time.perf_counter() - started
    keys = ("step", "reward/score_mean", "agent/tool_calls_per_episode", "agent/turns_mean", "val/score_mean",
            "time/step_s")
    curve = [{key: record[key] for key in keys if key in record} for record in history]
    changes = {name: paired_change(early["task_pass_rates"], late["task_pass_rates"])
               for name, early, late in (("greedy", before, after), ("sampled", sampled_before, sampled_after))
               if early is not None and late is not None and len(val) >= 2}
    summary = {"before": before, "after": after, "sampled_before": sampled_before, "sampled_after": sampled_after,
               "change": changes, "times": times, "curve": curve, "config": asdict(config),
               "environment": environment.__name__, "tasks": {"train": len(train), "heldout": len(val)}}
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    # calculator_learns.main builds its options from LearnsConfig and calls its own run: the same loop, here
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir")
    for name, default in asdict(CodingLearnsConfig()).items():
        if name != "output_dir":
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    summary = run(CodingLearnsConfig(**vars(parser.parse_args(argv))))
    shown = {key: headline(summary[key]) for key in ("before", "after", "sampled_before", "sampled_after")}
    print(json.dumps({**shown, "change": summary["change"], "times": summary["times"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
