"""TRL's side: GRPOTrainer on the shared assets, timing each step and its generate / score / update split.

Runs in the suite's own virtual environment (torch + trl); imports nothing from hybridflow.
Prints one JSON line per optimizer step.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

from side_args import side_parser


def main() -> None:
    args = side_parser(threads=True).parse_args()

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).parent))
    from reward import addition_reward

    def reward_fn(prompts, completions, **kwargs):
        return [addition_reward(p, c) for p, c in zip(prompts, completions)]

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    dataset = load_dataset("json", data_files=args.prompts, split="train")
    samples = args.prompts_per_step * args.samples_per_prompt
    config = GRPOConfig(
        output_dir=args.output_dir, use_cpu=True, bf16=args.bf16, fp16=False, learning_rate=args.lr,
        per_device_train_batch_size=samples, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=args.samples_per_prompt, num_iterations=1, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, max_steps=args.steps, logging_steps=1, report_to=[],
        lr_scheduler_type="constant", save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True,
        generation_kwargs={"min_new_tokens": args.min_new_tokens} if args.min_new_tokens else None,
        **({"gradient_checkpointing": False} if args.no_gradient_checkpointing else {}))
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=config, train_dataset=dataset,
                          processing_class=tokenizer)

    split = {"generate": 0.0, "rollout": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                split[name] += time.perf_counter() - start
        return wrapper

    trainer._generate = timed("generate", trainer._generate)
    trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions)
    lengths: list[float] = []
    original_rewards = trainer._calculate_rewards

    def rewards_with_lengths(inputs, prompts, completions, completion_ids_list):
        lengths.append(sum(len(ids) for ids in completion_ids_list) / len(completion_ids_list))
        prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in prompts)
        lengths.append(prompt_tokens)
        return original_rewards(inputs, prompts, completions, completion_ids_list)

    trainer._calculate_rewards = rewards_with_lengths

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            split.update(generate=0.0, rollout=0.0)
            lengths.clear()
            self.start = time.perf_counter()
            self.cpu_start = time.process_time()

        def on_step_end(self, *_, **__):
            step_s = time.perf_counter() - self.start
            mean_length = lengths[0]
            print(json.dumps({
                "step_s": step_s, "cpu_s": time.process_time() - self.cpu_start, "generate_s": split["generate"], "score_s": split["rollout"] - split["generate"],
                "update_s": step_s - split["rollout"], "completion_length": mean_length,
                "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                "load": os.getloadavg()[0]}), flush=True)

    trainer.add_callback(StepTimer())
    trainer.train()


if __name__ == "__main__":
    main()
