"""`hybridflow demo`: the whole RLHF pipeline on the built-in arithmetic task, on a CPU, in minutes.

1. SFT of the policy from scratch with few steps on worked problems -> a weak policy (by design);
2. the reward model: a backbone trained longer on worked problems (a stronger model than the
   policy, like the paper's larger reward models), then Bradley-Terry on preference pairs the
   task's exact checker labels: the correct answer against wrong answers sampled from the SFT
   policy itself and against plausible wrong answers (a digit off, a dropped carry, ...);
3. PPO (GAE with a critic) of the weak policy against that reward model alone.
The exact checker never enters the PPO reward: it only measures held-out accuracy (greedy answers
to problems of the eval split, which no stage trains on) after SFT and during PPO. Outputs:
metrics JSONL + TensorBoard per stage, a PNG of reward and accuracy per PPO step, and a closing
summary (also saved as summary.json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hybridflow.trainers.config_loader import apply_overrides, build_dataclass, to_plain

# Response budget of the task: at most 3 answer digits (99+99) plus EOS, and one spare token so a
# policy that fails to stop is visible (and penalized) rather than cut at exactly the right length.
MAX_RESPONSE_TOKENS = 5


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Sizes and knobs of the demo (defaults tuned for about ten minutes on 2 CPU cores)."""

    output_dir: str = "runs/demo"
    """Everything the demo writes goes here."""
    seed: int = 0
    """Seeds data, initialization and sampling."""
    max_digits: int = 2
    """Operands have 1..max_digits digits (addition); 2 gives 10,000 problems, 10% of them held out."""
    reverse_answer: bool = True
    """Answers written least-significant digit first (the task's fast-to-learn order; see the task module)."""
    forget_carry_rate: float = 0.0
    """Share of carrying additions the policy's demonstrator answers without carries (an imperfect demonstrator);
    0 is a perfect one. The policy stays weak through few SFT steps either way."""
    sft_steps: int = 700
    """Policy SFT optimizer steps (few on purpose: the policy should stay weak)."""
    sft_batch_size: int = 32
    """SFT rows per step (policy and reward-model backbone)."""
    sft_lr: float = 3e-3
    """SFT learning rate (policy and reward-model backbone)."""
    rm_backbone_sft_steps: int = 2000
    """SFT steps of the reward model's backbone: the RM starts from a longer-trained model than the policy
    (a stronger judge than the actor, like the paper's larger reward models); 0 means the policy's SFT model."""
    rm_policy_samples: int = 2
    """Responses sampled from the SFT policy per reward-model prompt; the wrong ones become rejected answers."""
    rm_steps: int = 800
    """Reward-model optimizer steps."""
    rm_batch_size: int = 32
    """Preference pairs per step."""
    rm_lr: float = 1e-3
    """Reward-model learning rate."""
    ppo_steps: int = 60
    """PPO iterations."""
    prompts_per_step: int = 32
    """Prompts per PPO iteration."""
    samples_per_prompt: int = 4
    """Responses per prompt."""
    mini_batch_size: int = 64
    """Samples per PPO optimizer update."""
    actor_lr: float = 1e-3
    """PPO actor learning rate."""
    critic_lr: float = 1e-3
    """PPO critic learning rate."""
    kl_coef: float = 0.02
    """KL penalty coefficient (in the reward)."""
    num_eval_prompts: int = 256
    """Held-out problems (eval split) for the accuracy curve and the reward model's held-out pairs."""
    val_every: int = 5
    """Validate every N PPO steps."""
    num_threads: int = 1
    """torch compute threads per demo process; 1 is fastest for models this small (and on a busy machine)."""
    parallel_backbone: bool = True
    """Train the reward model's backbone in a second process while the policy's SFT runs (two cores)."""
    mode: str = "local"
    """``local``: every role inside this process (fastest on a laptop); ``ray``: one process per role."""

    def __post_init__(self) -> None:
        for name in ("rm_backbone_sft_steps", "rm_policy_samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"config key {name} got {getattr(self, name)!r}; allowed: an integer >= 0")
        for name in ("sft_steps", "sft_batch_size", "rm_steps", "rm_batch_size", "ppo_steps", "prompts_per_step",
                     "samples_per_prompt", "mini_batch_size", "num_eval_prompts", "val_every", "max_digits",
                     "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"config key {name} got {getattr(self, name)!r}; allowed: an integer >= 1")
        if not 0.0 <= self.forget_carry_rate <= 1.0:
            raise ValueError(f"config key forget_carry_rate got {self.forget_carry_rate!r}; allowed: a float in [0, 1]")
        if self.mode not in ("local", "ray"):
            raise ValueError(f"config key mode got {self.mode!r}; allowed: 'local', 'ray'")


def _task(config: DemoConfig):
    from hybridflow.data.builtin import ArithmeticTaskConfig

    return ArithmeticTaskConfig(max_digits=config.max_digits, reverse_answer=config.reverse_answer)


def write_task_data(config: DemoConfig, directory: Path) -> dict[str, Path]:
    """The demo's jsonl files: SFT rows, synthetic preference pairs, RL prompts, held-out prompts.

    Every training file draws from the task's train split and every held-out file from its eval
    split; the two are disjoint by construction (see hybridflow.data.builtin.arithmetic).
    """
    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import preference_rows, prompt_rows, sft_rows

    task, seed = _task(config), config.seed
    return {
        "sft_policy": write_jsonl(directory / "sft_policy.jsonl", sft_rows(
            config.sft_steps * config.sft_batch_size, split="train", seed=seed, config=task,
            forget_carry_rate=config.forget_carry_rate)),
        "sft_backbone": write_jsonl(directory / "sft_backbone.jsonl", sft_rows(
            max(config.rm_backbone_sft_steps, 1) * config.sft_batch_size, split="train", seed=seed + 6, config=task)),
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
    return [f"batch_size={batch_size}", "epochs=1", f"max_steps={steps}", f"optim.lr={lr}",
            f"optim.warmup_steps={max(1, steps // 10)}", "optim.schedule=cosine", f"seed={config.seed}"]


def train_sft(config: DemoConfig, data_file: Path, output_dir: Path, *, steps: int, tensorboard: bool,
              progress_bar: bool = True) -> dict:
    """One SFT run from scratch on worked problems."""
    from hybridflow.trainers.supervised import SFTConfig, load_supervised_config, run_supervised

    return run_supervised(load_supervised_config(SFTConfig, None, [
        "model.builtin=arithmetic", f"data.train_path={data_file}", f"output_dir={output_dir}",
        f"progress_bar={str(progress_bar).lower()}",
        *_supervised_overrides(config, steps=steps, batch_size=config.sft_batch_size, lr=config.sft_lr)]),
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


def train_reward_model(config: DemoConfig, pairs: Path, pairs_eval: Path, output_dir: Path, *, backbone_dir: str,
                       tensorboard: bool) -> dict:
    """Bradley-Terry training of a score head on the backbone; held-out pair accuracy in ``final['val/accuracy']``."""
    from hybridflow.trainers.supervised import RMConfig, load_supervised_config, run_supervised

    return run_supervised(load_supervised_config(RMConfig, None, [
        f"model.path={backbone_dir}", f"data.train_path={pairs}", f"data.val_path={pairs_eval}",
        f"output_dir={output_dir}", f"eval_every={max(1, config.rm_steps // 4)}",
        *_supervised_overrides(config, steps=config.rm_steps, batch_size=config.rm_batch_size, lr=config.rm_lr)]),
        mode=config.mode, tensorboard=tensorboard)


def build_ppo_trainer(config: DemoConfig, files: dict[str, Path], root: Path, *, policy_dir: str, reward_dir: str,
                      tensorboard: bool):
    """An RLTrainer running PPO of the policy against the reward model (the checker only validates)."""
    from hybridflow.trainers.config import load_rl_config
    from hybridflow.trainers.ppo import RLTrainer

    rl_config = load_rl_config(None, [
        f"data.train_path={files['prompts']}", f"data.val_path={files['prompts_eval']}",
        f"actor.model.path={policy_dir}", f"actor.optim.lr={config.actor_lr}",
        f"actor.generation.max_new_tokens={MAX_RESPONSE_TOKENS}",
        f"critic.optim.lr={config.critic_lr}", f"reward.model.path={reward_dir}",
        f"algorithm.kl_coef={config.kl_coef}", f"batch.prompts_per_step={config.prompts_per_step}",
        f"batch.samples_per_prompt={config.samples_per_prompt}", f"batch.mini_batch_size={config.mini_batch_size}",
        f"trainer.total_steps={config.ppo_steps}", f"trainer.val_every={config.val_every}",
        "trainer.val_function=arithmetic", f"trainer.output_dir={root / 'ppo'}", f"trainer.seed={config.seed}",
        "trainer.resume=false"])
    return RLTrainer(rl_config, mode=config.mode, tensorboard=tensorboard)


def _train_backbone(config: DemoConfig, data_file: Path, output_dir: Path, tensorboard: bool) -> str:
    """SFT of the reward model's backbone on correct worked problems; returns the exported model directory."""
    import torch

    torch.set_num_threads(config.num_threads)
    # a bar per process would garble the terminal: only the policy's SFT (in the main process) shows one
    return train_sft(config, data_file, output_dir, steps=config.rm_backbone_sft_steps, tensorboard=tensorboard,
                     progress_bar=multiprocessing.parent_process() is None)["model_dir"]


def run_demo(config: DemoConfig, *, tensorboard: bool = True) -> dict:
    """Run the stages; returns the summary dict."""
    import torch

    torch.set_num_threads(config.num_threads)
    start = time.perf_counter()
    root = Path(config.output_dir)
    files = write_task_data(config, root / "data")

    backbone = None
    if config.rm_backbone_sft_steps and config.parallel_backbone:
        # The backbone's SFT does not depend on the policy: it runs in a second process meanwhile (one core each).
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        backbone = pool.submit(_train_backbone, config, files["sft_backbone"], root / "rm_backbone", tensorboard)
        pool.shutdown(wait=False)
        print(f"[1/3] SFT of the policy from scratch ({config.sft_steps} steps on worked problems); meanwhile, in a "
              f"second process, SFT of the reward model's backbone ({config.rm_backbone_sft_steps} steps)")
    else:
        print(f"[1/3] SFT of the policy from scratch ({config.sft_steps} steps on worked problems)")
    sft = train_sft(config, files["sft_policy"], root / "sft", steps=config.sft_steps, tensorboard=tensorboard)
    print("[2/3] reward model: Bradley-Terry on checker-labelled pairs, from a longer-trained backbone")
    pairs, pairs_eval = write_preference_pairs(config, files, root / "data", policy_dir=sft["model_dir"])
    backbone_dir = sft["model_dir"]
    if backbone is not None:
        backbone_dir = backbone.result()
    elif config.rm_backbone_sft_steps:
        backbone_dir = _train_backbone(config, files["sft_backbone"], root / "rm_backbone", tensorboard)
    rm = train_reward_model(config, pairs, pairs_eval, root / "rm", backbone_dir=backbone_dir, tensorboard=tensorboard)
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
