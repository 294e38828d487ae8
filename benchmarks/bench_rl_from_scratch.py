"""Can RL teach the arithmetic itself? PPO/GRPO from policies SFT'd from scratch, on the built-in task.

The measurements behind the demo's design (docs/demo.md): 60 RL steps of 32 prompts x 4 samples
from a policy trained from random weights for 700 or 1,000 SFT steps (1- and 2-digit addition,
answers reversed), with the exact checker or a likelihood reward model (a 2,000-step SFT model)
as the reward; a plain PyTorch GRPO loop on the same data as a check on the framework; and a
prompt-independent habit ("start the answer with 5") for contrast. Prints one line per run:
held-out greedy accuracy (256 eval-split problems, exact checker) before and after.

    python benchmarks/bench_rl_from_scratch.py --out /tmp/rl_from_scratch            # every run, ~20 min
    python benchmarks/bench_rl_from_scratch.py --out /tmp/rl_from_scratch --runs ppo_rule_1e-4,plain_grpo_1e-3
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

TASK_SEED = 0
PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, MAX_NEW_TOKENS = 32, 4, 5


def starts_with_5(prompt: str, response: str, **fields) -> float:
    """The habit reward: 1 when the answer starts with the digit 5, whatever the problem."""
    return float(response.strip().startswith("5"))


def write_data(directory: Path) -> dict[str, Path]:
    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows, sft_rows

    task = ArithmeticTaskConfig(max_digits=2, reverse_answer=True)
    return {
        "sft": write_jsonl(directory / "sft.jsonl", sft_rows(1000 * 32, split="train", seed=TASK_SEED, config=task)),
        "judge": write_jsonl(directory / "judge.jsonl", sft_rows(2000 * 32, split="train", seed=TASK_SEED + 6,
                                                                 config=task)),
        "prompts": write_jsonl(directory / "prompts.jsonl", prompt_rows(60 * PROMPTS_PER_STEP, split="train",
                                                                        seed=TASK_SEED + 2, config=task)),
        "eval": write_jsonl(directory / "eval.jsonl", prompt_rows(256, split="eval", seed=TASK_SEED + 3, config=task)),
    }


def sft_from_scratch(data: Path, output_dir: Path, steps: int) -> str:
    """The demo's SFT schedule (batch 32, lr 3e-3, 10% warmup, cosine) from random weights; returns the model dir."""
    if (output_dir / "model" / "model.safetensors").exists():
        return str(output_dir / "model")
    from hybridflow.trainers.supervised import SFTConfig, load_supervised_config, run_supervised

    return run_supervised(load_supervised_config(SFTConfig, None, [
        "model.builtin=arithmetic", f"data.train_path={data}", f"output_dir={output_dir}", "progress_bar=false",
        "batch_size=32", "epochs=1", f"max_steps={steps}", "engine.optim.lr=3e-3", f"engine.optim.warmup_steps={steps // 10}",
        "engine.optim.lr_schedule=cosine", "seed=0"]), mode="local", tensorboard=False)["model_dir"]


def rl_run(files: dict[str, Path], output_dir: Path, *, policy: str, reward: list[str], steps: int,
           extra: list[str]) -> tuple[float, float]:
    """(held-out accuracy before, after) of one RLTrainer run."""
    from hybridflow.controller import local_mode
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import RLTrainer

    config = load_rl_config(None, [
        f"data.train_path={files['prompts']}", f"data.val_path={files['eval']}", f"actor.model.path={policy}",
        f"actor.generation.max_new_tokens={MAX_NEW_TOKENS}", "critic.engine.optim.lr=1e-3", "algorithm.kl_coef=0.02",
        f"batch.prompts_per_step={PROMPTS_PER_STEP}", f"batch.samples_per_prompt={SAMPLES_PER_PROMPT}",
        "batch.mini_batch_size=64", f"trainer.total_steps={steps}", f"trainer.val_every={steps}",
        "trainer.val_function=arithmetic", f"trainer.output_dir={output_dir}", "trainer.resume=false",
        "trainer.overwrite=true",
        "trainer.progress_bar=false", *reward, *extra])
    with local_mode():
        trainer = RLTrainer(config, tensorboard=False)
        try:
            before = trainer.validate()["val/function_mean"]
            history = trainer.fit()
        finally:
            trainer.shutdown()
    return before, history[-1]["val/function_mean"]


def plain_grpo(files: dict[str, Path], policy: str, *, lr: float, steps: int = 60) -> tuple[float, float]:
    """GRPO written directly on the transformers model (no hybridflow engine, worker or driver)."""
    from transformers import AutoModelForCausalLM

    from hybridflow.data import read_rows
    from hybridflow.data.builtin import builtin_tokenizer, score

    torch.manual_seed(0)
    tokenizer, model = builtin_tokenizer(), AutoModelForCausalLM.from_pretrained(policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    train, held_out = list(read_rows(files["prompts"])), list(read_rows(files["eval"]))

    def generate(prompts: list[str], sample: bool, samples: int = 1):
        inputs = tokenizer(prompts, padding=True, return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, do_sample=sample, max_new_tokens=MAX_NEW_TOKENS,
                                    num_return_sequences=samples, pad_token_id=tokenizer.pad_token_id,
                                    eos_token_id=tokenizer.eos_token_id)
        return inputs, output

    def accuracy() -> float:
        inputs, output = generate([row["prompt"] for row in held_out], sample=False)
        texts = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        return sum(score(row["prompt"], text, answer=row["answer"]) for row, text in zip(held_out, texts)) / len(texts)

    before, rng = accuracy(), random.Random(0)
    for _ in range(steps):
        rows = rng.sample(train, PROMPTS_PER_STEP)
        inputs, output = generate([row["prompt"] for row in rows], sample=True, samples=SAMPLES_PER_PROMPT)
        prompt_length = inputs["input_ids"].shape[1]
        responses_BT = output[:, prompt_length:]
        texts = tokenizer.batch_decode(responses_BT, skip_special_tokens=True)
        rewards_GS = torch.tensor([score(rows[index // SAMPLES_PER_PROMPT]["prompt"], text,
                                         answer=rows[index // SAMPLES_PER_PROMPT]["answer"])
                                   for index, text in enumerate(texts)]).view(-1, SAMPLES_PER_PROMPT)
        advantages_B = ((rewards_GS - rewards_GS.mean(1, keepdim=True)) / (rewards_GS.std(1, keepdim=True) + 1e-6)).view(-1)
        is_eos_BT = (responses_BT == tokenizer.eos_token_id).int()
        after_eos_BT = (is_eos_BT.cumsum(1) - is_eos_BT) > 0
        mask_BT = ~after_eos_BT & ((responses_BT != tokenizer.pad_token_id) | is_eos_BT.bool())
        attention_BS = torch.cat([inputs["attention_mask"].repeat_interleave(SAMPLES_PER_PROMPT, 0), mask_BT.long()], 1)
        logits = model(input_ids=output, attention_mask=attention_BS,
                       position_ids=(attention_BS.cumsum(1) - 1).clamp(min=0)).logits[:, prompt_length - 1:-1]
        logprobs_BT = logits.log_softmax(-1).gather(-1, responses_BT[..., None]).squeeze(-1)
        loss = -(advantages_B[:, None] * logprobs_BT * mask_BT).sum() / mask_BT.sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return before, accuracy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/rl_from_scratch")
    parser.add_argument("--runs", default="", help="comma-separated run names (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(args.out)
    files = write_data(root / "data")
    policies = {}

    def policy(steps: int) -> str:
        if steps not in policies:
            policies[steps] = sft_from_scratch(files["sft"], root / f"sft{steps}", steps)
        return policies[steps]

    def judge() -> list[str]:
        return [f"reward.model.path={sft_from_scratch(files['judge'], root / 'judge2000', 2000)}",
                "reward.model_type=likelihood"]

    rule = ["reward.function=arithmetic"]
    habit = [f"reward.function={Path(__file__).resolve()}:starts_with_5"]
    runs = {
        "ppo_rule_1e-4": lambda: rl_run(files, root / "r1", policy=policy(700), reward=rule, steps=60,
                                        extra=["actor.engine.optim.lr=1e-4"]),
        "ppo_rule_3e-4": lambda: rl_run(files, root / "r2", policy=policy(700), reward=rule, steps=60,
                                        extra=["actor.engine.optim.lr=3e-4"]),
        "ppo_rule_1e-3": lambda: rl_run(files, root / "r3", policy=policy(700), reward=rule, steps=60,
                                        extra=["actor.engine.optim.lr=1e-3"]),
        "ppo_likelihood_3e-4": lambda: rl_run(files, root / "l1", policy=policy(700), reward=judge(), steps=60,
                                              extra=["actor.engine.optim.lr=3e-4", "critic.loss.value_clip=0"]),
        "reinforce++_likelihood_3e-4": lambda: rl_run(
            files, root / "l2", policy=policy(700), reward=judge(), steps=60,
            extra=["actor.engine.optim.lr=3e-4", "algorithm.advantage_estimator=reinforce_plus_plus"]),
        "grpo_rule_1e-4": lambda: rl_run(files, root / "g1", policy=policy(1000), reward=rule, steps=60,
                                         extra=["actor.engine.optim.lr=1e-4", "algorithm.advantage_estimator=grpo"]),
        "grpo_rule_1e-3": lambda: rl_run(files, root / "g2", policy=policy(1000), reward=rule, steps=60,
                                         extra=["actor.engine.optim.lr=1e-3", "algorithm.advantage_estimator=grpo"]),
        "grpo_rule_3e-3": lambda: rl_run(files, root / "g3", policy=policy(1000), reward=rule, steps=60,
                                         extra=["actor.engine.optim.lr=3e-3", "algorithm.advantage_estimator=grpo"]),
        "plain_grpo_1e-4": lambda: plain_grpo(files, policy(1000), lr=1e-4),
        "plain_grpo_1e-3": lambda: plain_grpo(files, policy(1000), lr=1e-3),
    }
    known = [*runs, "habit_starts_with_5"]
    selected = [name for name in args.runs.split(",") if name] or known
    unknown = sorted(set(selected) - set(known))
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; known: {', '.join(known)}")
    for name in selected:
        start = time.perf_counter()
        if name == "habit_starts_with_5":
            from hybridflow.data import read_rows

            # the share of *training samples* that start with 5 (the habit), not held-out accuracy
            rl_run(files, root / "habit", policy=policy(700), reward=habit, steps=20, extra=["actor.engine.optim.lr=3e-4"])
            records = list(read_rows(root / "habit" / "metrics.jsonl"))
            print(json.dumps({"run": name, "samples_starting_with_5": {
                record["step"]: round(record["reward/score_mean"], 3) for record in records if record["step"] in (1, 5, 20)},
                "seconds": round(time.perf_counter() - start)}), flush=True)
            continue
        before, after = runs[name]()
        print(json.dumps({"run": name, "held_out_before": round(before, 4), "held_out_after": round(after, 4),
                          "seconds": round(time.perf_counter() - start)}), flush=True)


if __name__ == "__main__":
    main()
