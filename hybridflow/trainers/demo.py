"""`hybridflow demo`: the whole RLHF pipeline on the built-in arithmetic task, on a CPU, in minutes.

The pipeline of InstructGPT, in miniature:
0. a *base model* trained from scratch on correct worked problems stands in for a pretrained LM;
1. SFT of the policy from the base on the demonstrations of an imperfect demonstrator, who leaves
   out the final carry digit of most sums that need one ("57+68=" -> "25"): the policy learns the
   flaw along with the demonstrations, so it is weak (under half of the held-out problems right);
2. a reward model from the base, trained with the Bradley-Terry loss on preference pairs the task's
   exact checker labels: the correct answer against the SFT policy's own wrong samples and against
   plausible wrong answers (a digit off, a dropped carry, ...);
3. PPO (GAE with a critic) of the SFT policy against that reward model alone.
The exact checker never enters the PPO reward: it only measures held-out accuracy (greedy answers
to problems of the eval split, which no stage trains on) after SFT and during PPO. Outputs:
metrics JSONL + TensorBoard per stage, a PNG of reward and accuracy per PPO step, and a closing
summary (also saved as summary.json).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from hybridflow.trainers.config.loader import apply_overrides, build_dataclass, to_plain

# Response budget of the task: at most 3 answer digits (99+99) plus EOS, and one spare token so a
# policy that fails to stop is visible (and penalized) rather than cut at exactly the right length.
MAX_RESPONSE_TOKENS = 5


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Sizes and knobs of the demo (defaults: about five minutes on 2 CPU cores)."""

    output_dir: str = "runs/demo"
    """Everything the demo writes goes here."""
    seed: int = 0
    """Seeds data, initialization and sampling."""
    min_digits: int = 2
    """Operands have min_digits..max_digits digits (addition); 2..2 gives 8,100 problems, 10% of them held out."""
    max_digits: int = 2
    """See min_digits."""
    reverse_answer: bool = True
    """Answers written least-significant digit first (the task's fast-to-learn order; see the task module)."""
    drop_final_carry_rate: float = 0.7
    """Share of the sums whose last carry opens a new digit (57+68=125) that the policy's demonstrator writes
    without that digit ("25" instead of "125"): the flaw the SFT policy learns and PPO has to remove."""
    forget_carry_rate: float = 0.0
    """Share of carrying sums the demonstrator writes without any carry (a second, harsher flaw; 0: off)."""
    base_steps: int = 2000
    """Optimizer steps of the base model (from random weights, on correct worked problems)."""
    base_lr: float = 3e-3
    """Base model learning rate (warmup, then cosine)."""
    sft_steps: int = 300
    """Policy SFT optimizer steps, from the base, on the flawed demonstrations."""
    sft_lr: float = 1e-3
    """Policy SFT learning rate."""
    sft_batch_size: int = 32
    """Rows per step (base model and policy SFT)."""
    rm_type: str = "likelihood"
    """``likelihood``: the reward is the response's summed token log-probs under the reward model, credited
    token by token; ``score_head``: a scalar head read at the last token (see docs/demo.md for both)."""
    rm_policy_samples: int = 2
    """Responses sampled from the SFT policy per reward-model prompt; the wrong ones become rejected answers."""
    rm_steps: int = 200
    """Reward-model optimizer steps."""
    rm_batch_size: int = 32
    """Preference pairs per step."""
    rm_lr: float = 1e-4
    """Reward-model learning rate."""
    rm_nll_coef: float = 1.0
    """Likelihood reward model: weight of the chosen answers' NLL in its loss (keeps them likely)."""
    ppo_steps: int = 40
    """PPO iterations."""
    prompts_per_step: int = 32
    """Prompts per PPO iteration."""
    samples_per_prompt: int = 4
    """Responses per prompt."""
    mini_batch_size: int = 64
    """Samples per PPO optimizer update."""
    actor_lr: float = 1e-4
    """PPO actor learning rate."""
    critic_lr: float = 1e-3
    """PPO critic learning rate."""
    kl_coef: float = 0.02
    """KL penalty coefficient (in the reward)."""
    num_eval_prompts: int = 256
    """Held-out problems (eval split) for the accuracy curve and the reward model's held-out pairs."""
    val_every: int = 5
    """Validate every N PPO steps."""
    num_threads: int = 2
    """torch compute threads of the demo process."""
    mode: str = "local"
    """``local``: every role inside this process (fastest on a laptop); ``ray``: one process per role."""

    def __post_init__(self) -> None:
        if self.rm_policy_samples < 0:
            raise ValueError(f"config key rm_policy_samples got {self.rm_policy_samples!r}; allowed: an integer >= 0")
        for name in ("base_steps", "sft_steps", "sft_batch_size", "rm_steps", "rm_batch_size", "ppo_steps",
                     "prompts_per_step", "samples_per_prompt", "mini_batch_size", "num_eval_prompts", "val_every",
                     "max_digits", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"config key {name} got {getattr(self, name)!r}; allowed: an integer >= 1")
        for name in ("forget_carry_rate", "drop_final_carry_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"config key {name} got {getattr(self, name)!r}; allowed: a float in [0, 1]")
        for name in ("base_lr", "sft_lr", "rm_lr", "actor_lr", "critic_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"config key {name} got {getattr(self, name)!r}; allowed: a float > 0")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"config keys min_digits, max_digits got {self.min_digits!r}, {self.max_digits!r}; "
                             "allowed: 1 <= min_digits <= max_digits")
        if self.rm_type not in ("likelihood", "score_head"):
            raise ValueError(f"config key rm_type got {self.rm_type!r}; allowed: 'likelihood', 'score_head'")
        if self.mode not in ("local", "ray"):
            raise ValueError(f"config key mode got {self.mode!r}; allowed: 'local', 'ray'")


def _task(config: DemoConfig):
    from hybridflow.data.builtin import ArithmeticTaskConfig

    return ArithmeticTaskConfig(min_digits=config.min_digits, max_digits=config.max_digits,
                                reverse_answer=config.reverse_answer)


def write_task_data(config: DemoConfig, directory: Path) -> dict[str, Path]:
    """The demo's jsonl files: base-model rows, flawed SFT rows, synthetic pairs, RL prompts, held-out prompts.

    Every training file draws from the task's train split and every held-out file from its eval
    split; the two are disjoint by construction (see hybridflow.data.builtin.arithmetic).
    """
    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import preference_rows, prompt_rows, sft_rows

    task, seed = _task(config), config.seed
    return {
        "sft_base": write_jsonl(directory / "sft_base.jsonl", sft_rows(
            config.base_steps * config.sft_batch_size, split="train", seed=seed + 6, config=task)),
        "sft_policy": write_jsonl(directory / "sft_policy.jsonl", sft_rows(
            config.sft_steps * config.sft_batch_size, split="train", seed=seed, config=task,
            forget_carry_rate=config.forget_carry_rate, drop_final_carry_rate=config.drop_final_carry_rate)),
        "pairs_synthetic": write_jsonl(directory / "pairs_synthetic.jsonl", preference_rows(
            config.rm_steps * config.rm_batch_size, split="train", seed=seed + 1, config=task)),
        "pairs_eval_synthetic": write_jsonl(directory / "pairs_eval_synthetic.jsonl", preference_rows(
            config.num_eval_prompts, split="eval", seed=seed + 4, config=task)),
        "rm_prompts": write_jsonl(directory / "rm_prompts.jsonl", prompt_rows(
            config.rm_steps * config.rm_batch_size // 4, split="train", seed=seed + 5, config=task)),
        "prompts": write_jsonl(directory / "prompts.jsonl", prompt_rows(
            config.ppo_steps * config.prompts_per_step, split="train", seed=seed + 2, config=task)),
        "prompts_eval": write_jsonl(directory / "prompts_eval.jsonl", prompt_rows(
            config.num_eval_prompts, split="eval", seed=seed + 3, config=task)),
    }


def sample_policy_answers(model_dir: str, prompts: list[str], *, samples_per_prompt: int, seed: int,
                          batch_size: int = 256) -> list[list[str]]:
    """``samples_per_prompt`` answers (temperature 1) of an exported policy to each prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.data.builtin import builtin_tokenizer

    tokenizer = builtin_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(seed)
    answers: list[list[str]] = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            inputs = tokenizer(chunk, padding=True, return_tensors="pt")
            output = model.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                    max_new_tokens=MAX_RESPONSE_TOKENS, num_return_sequences=samples_per_prompt,
                                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            answers.extend(texts[row:row + samples_per_prompt] for row in range(0, len(texts), samples_per_prompt))
    return answers


def policy_preference_rows(model_dir: str, prompt_file: Path, *, samples_per_prompt: int, seed: int) -> list[dict]:
    """Pairs (correct answer, a wrong answer the policy sampled), labelled by the exact checker."""
    from hybridflow.data import read_rows
    from hybridflow.data.builtin import score

    prompt_rows = read_rows(prompt_file)
    samples = sample_policy_answers(model_dir, [row["prompt"] for row in prompt_rows],
                                    samples_per_prompt=samples_per_prompt, seed=seed)
    return [{"prompt": row["prompt"], "chosen": row["answer"], "rejected": answer.strip()}
            for row, answers in zip(prompt_rows, samples) for answer in answers
            if score(row["prompt"], answer, answer=row["answer"]) == 0.0]


def _supervised_overrides(config: DemoConfig, *, steps: int, batch_size: int, lr: float) -> list[str]:
    return [f"batch_size={batch_size}", "epochs=1", f"max_steps={steps}", f"engine.optim.lr={lr}",
            f"engine.optim.warmup_steps={max(1, steps // 10)}", "engine.optim.lr_schedule=cosine", f"seed={config.seed}"]


def train_sft(config: DemoConfig, data_file: Path, output_dir: Path, *, steps: int, lr: float, init_dir: str | None,
              tensorboard: bool) -> dict:
    """One SFT run on worked problems: from random weights (``init_dir`` None) or from a model directory."""
    from hybridflow.trainers.supervised import SFTConfig, load_supervised_config, run_supervised

    model = "model.builtin=arithmetic" if init_dir is None else f"model.path={init_dir}"
    return run_supervised(load_supervised_config(SFTConfig, None, [
        model, f"data.train_path={data_file}", f"output_dir={output_dir}", "overwrite=true",
        *_supervised_overrides(config, steps=steps, batch_size=config.sft_batch_size, lr=lr)]),
        mode=config.mode, tensorboard=tensorboard)


def write_preference_pairs(config: DemoConfig, files: dict[str, Path], directory: Path, *,
                           policy_dir: str) -> tuple[Path, Path]:
    """The reward model's train and held-out pairs: the policy's own wrong samples + synthetic wrong answers.

    Every pair is labelled by the exact checker (chosen: the correct answer). Returns (train, held-out) files.
    """
    from hybridflow.data import read_rows, write_jsonl

    train_rows = list(read_rows(files["pairs_synthetic"]))
    eval_rows = list(read_rows(files["pairs_eval_synthetic"]))
    if config.rm_policy_samples:
        policy_train = policy_preference_rows(policy_dir, files["rm_prompts"], samples_per_prompt=config.rm_policy_samples,
                                              seed=config.seed + 11)
        policy_eval = policy_preference_rows(policy_dir, files["prompts_eval"], samples_per_prompt=1,
                                             seed=config.seed + 12)
        print(f"      reward-model pairs: {len(policy_train)} from policy samples + {len(train_rows)} synthetic "
              f"(held out: {len(policy_eval)} + {len(eval_rows)})")
        train_rows += policy_train
        eval_rows += policy_eval
    random.Random(config.seed).shuffle(train_rows)
    return write_jsonl(directory / "pairs.jsonl", train_rows), write_jsonl(directory / "pairs_eval.jsonl", eval_rows)


def train_reward_model(config: DemoConfig, pairs: Path, pairs_eval: Path, output_dir: Path, *, base_dir: str,
                       tensorboard: bool) -> dict:
    """Bradley-Terry training from the base model; held-out pair accuracy in ``final['val/accuracy']``."""
    from hybridflow.trainers.supervised import RMConfig, load_supervised_config, run_supervised

    return run_supervised(load_supervised_config(RMConfig, None, [
        f"model.path={base_dir}", f"data.train_path={pairs}", f"data.val_path={pairs_eval}",
        f"output_dir={output_dir}", "overwrite=true", f"eval_every={max(1, config.rm_steps // 4)}",
        f"reward_type={config.rm_type}",
        f"nll_coef={config.rm_nll_coef if config.rm_type == 'likelihood' else 0.0}",
        *_supervised_overrides(config, steps=config.rm_steps, batch_size=config.rm_batch_size, lr=config.rm_lr)]),
        mode=config.mode, tensorboard=tensorboard)


def build_ppo_trainer(config: DemoConfig, files: dict[str, Path], root: Path, *, policy_dir: str, reward_dir: str,
                      tensorboard: bool):
    """An RLTrainer running PPO of the policy against the reward model (the checker only validates)."""
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import RLTrainer

    rl_config = load_rl_config(None, [
        f"data.train_path={files['prompts']}", f"data.val_path={files['prompts_eval']}",
        f"actor.model.path={policy_dir}", f"actor.engine.optim.lr={config.actor_lr}",
        f"actor.generation.max_new_tokens={MAX_RESPONSE_TOKENS}",
        f"critic.engine.optim.lr={config.critic_lr}", f"reward.model.path={reward_dir}", f"reward.model_type={config.rm_type}",
        f"algorithm.kl_coef={config.kl_coef}", f"batch.prompts_per_step={config.prompts_per_step}",
        f"batch.samples_per_prompt={config.samples_per_prompt}", f"batch.mini_batch_size={config.mini_batch_size}",
        f"trainer.total_steps={config.ppo_steps}", f"trainer.val_every={config.val_every}",
        "trainer.val_function=arithmetic", f"trainer.output_dir={root / 'ppo'}", f"trainer.seed={config.seed}",
        "trainer.resume=false", "trainer.overwrite=true", "trainer.val_before_train=false"])  # the SFT model's accuracy is measured above
    return RLTrainer(rl_config, mode=config.mode, tensorboard=tensorboard)


def run_demo(config: DemoConfig, *, tensorboard: bool = True) -> dict:
    """Run the stages; returns the summary dict."""
    import torch

    torch.set_num_threads(config.num_threads)
    start = time.perf_counter()
    root = Path(config.output_dir)
    files = write_task_data(config, root / "data")

    print(f"[0/3] base model from random weights ({config.base_steps} steps on correct worked problems; "
          "stands in for a pretrained LM)")
    base = train_sft(config, files["sft_base"], root / "base", steps=config.base_steps, lr=config.base_lr,
                     init_dir=None, tensorboard=tensorboard)
    print(f"[1/3] SFT of the policy from the base ({config.sft_steps} steps on an imperfect demonstrator's answers)")
    sft = train_sft(config, files["sft_policy"], root / "sft", steps=config.sft_steps, lr=config.sft_lr,
                    init_dir=base["model_dir"], tensorboard=tensorboard)
    print(f"[2/3] reward model ({config.rm_type}) from the base: Bradley-Terry on checker-labelled pairs")
    pairs, pairs_eval = write_preference_pairs(config, files, root / "data", policy_dir=sft["model_dir"])
    rm = train_reward_model(config, pairs, pairs_eval, root / "rm", base_dir=base["model_dir"], tensorboard=tensorboard)
    print(f"      reward model held-out pair accuracy: {rm['final']['val/accuracy']:.1%}")
    print("[3/3] PPO against the reward model; accuracy by the exact checker on held-out problems")
    trainer = build_ppo_trainer(config, files, root, policy_dir=sft["model_dir"], reward_dir=rm["model_dir"],
                                tensorboard=tensorboard)
    try:
        before = trainer.validate()
        print(f"      held-out accuracy before PPO: {before['val/function_mean']:.1%}")
        history = trainer.fit()
    finally:
        trainer.shutdown()

    accuracy_curve = [(0, before["val/function_mean"])] + [
        (record["step"], record["val/function_mean"]) for record in history if "val/function_mean" in record]
    plot_path = plot_progress(history, accuracy_curve, root / "progress.png")
    summary = {
        "sft_accuracy": before["val/function_mean"],
        "ppo_accuracy": accuracy_curve[-1][1],
        "best_ppo_accuracy": max(value for _, value in accuracy_curve),
        "rm_val_accuracy": rm["final"]["val/accuracy"],
        "num_eval_prompts": config.num_eval_prompts,
        "reward_first_step": history[0]["reward/score_mean"],
        "reward_last_step": history[-1]["reward/score_mean"],
        "minutes": (time.perf_counter() - start) / 60,
        "plot": str(plot_path),
        "metrics": str(trainer.logger.path),
        "config": to_plain(config),
    }
    (root / "summary.json").write_text(json.dumps(summary, indent=2))
    print(format_summary(summary))
    return summary


def plot_progress(history: list[dict], accuracy_curve: list[tuple[int, float]], path: Path) -> Path:
    """PNG with the mean reward-model score per PPO step and the held-out accuracy per validation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, reward_axis = plt.subplots(figsize=(7, 4))
    steps = [record["step"] for record in history]
    reward_axis.plot(steps, [record["reward/score_mean"] for record in history], color="tab:blue",
                     label="mean reward-model score (training samples)")
    reward_axis.set_xlabel("PPO step")
    reward_axis.set_ylabel("mean reward", color="tab:blue")
    accuracy_axis = reward_axis.twinx()
    accuracy_axis.plot([step for step, _ in accuracy_curve], [value for _, value in accuracy_curve], "o-",
                       color="tab:red", label="held-out accuracy (exact checker, greedy)")
    accuracy_axis.set_ylabel("held-out accuracy", color="tab:red")
    accuracy_axis.set_ylim(0, 1)
    handles = reward_axis.get_legend_handles_labels()[0] + accuracy_axis.get_legend_handles_labels()[0]
    reward_axis.legend(handles, [handle.get_label() for handle in handles], loc="lower right", fontsize="small")
    figure.suptitle("hybridflow demo: PPO against a learned reward model (arithmetic)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def format_summary(summary: dict) -> str:
    """The closing summary printed at the end of the demo."""
    held_out = summary["num_eval_prompts"]
    return "\n".join([
        "",
        "hybridflow demo summary",
        f"  held-out accuracy after SFT     : {summary['sft_accuracy']:.1%} ({held_out} unseen problems, exact checker)",
        f"  reward model held-out pair acc. : {summary['rm_val_accuracy']:.1%}",
        f"  held-out accuracy after PPO     : {summary['ppo_accuracy']:.1%} (best {summary['best_ppo_accuracy']:.1%})",
        f"  mean reward, first -> last step : {summary['reward_first_step']:.3f} -> {summary['reward_last_step']:.3f}",
        f"  wall time                       : {summary['minutes']:.1f} min",
        f"  plot                            : {summary['plot']}",
        f"  metrics                         : {summary['metrics']} (TensorBoard: {Path(summary['metrics']).parent / 'tensorboard'})",
    ])


def main(argv: list[str]) -> int:
    """`hybridflow demo [key=value ...]` (keys of DemoConfig, e.g. output_dir=/tmp/demo ppo_steps=10)."""
    parser = argparse.ArgumentParser(prog="hybridflow demo", description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="DemoConfig key=value overrides (output_dir, ppo_steps, ...)")
    args = parser.parse_args(argv)
    try:
        config = build_dataclass(DemoConfig, apply_overrides({}, args.overrides))
    except ValueError as error:
        print(f"hybridflow demo: error: {error}")
        return 2
    run_demo(config)
    return 0
