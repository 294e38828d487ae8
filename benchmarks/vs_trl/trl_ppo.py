"""TRL's side of PPO: PPOTrainer (trl 1.12, ``trl.experimental.ppo``) on the shared assets.

Policy and reference from ``--model-dir``; reward model and value model both from ``--score-dir``
(assets.build_score_model_dir). Runs in the suite's own virtual environment; imports nothing from
hybridflow. Prints one JSON line per PPO step with the same fields as trl_grpo.py: generate = the
sampling (``batch_generation``), score = the rest of the rollout (reference, value and reward forwards,
KL shaping, GAE), update = the policy + value forward/backward and optimizer step.
"""

from __future__ import annotations

import json
import os
import resource
import time

from side_args import side_parser


def main() -> None:
    args = side_parser(score_model=True, threads=True).parse_args()
    if args.samples_per_prompt != 1:
        raise ValueError(f"--samples-per-prompt: PPOTrainer samples one response per prompt (allowed: 1), "
                         f"got {args.samples_per_prompt}")

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    value_model = AutoModelForSequenceClassification.from_pretrained(args.score_dir, num_labels=1, dtype=torch.float32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(args.score_dir, num_labels=1, dtype=torch.float32)
    dataset = load_dataset("json", data_files=args.prompts, split="train")
    dataset = dataset.map(lambda row: {"input_ids": tokenizer(row["prompt"])["input_ids"]},
                          remove_columns=dataset.column_names)
    batch = args.prompts_per_step
    config = PPOConfig(
        output_dir=args.output_dir, use_cpu=True, bf16=args.bf16, fp16=False, gradient_checkpointing=False,
        learning_rate=args.lr, lr_scheduler_type="constant", per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, num_mini_batches=1, num_ppo_epochs=1, total_episodes=batch * args.steps,
        local_rollout_forward_batch_size=batch, response_length=args.max_new_tokens, stop_token="eos",
        temperature=1.0, kl_coef=args.kl_coef, kl_estimator="k1", gamma=1.0, lam=0.95, cliprange=0.2,
        cliprange_value=0.2, vf_coef=0.1, whiten_rewards=False, missing_eos_penalty=None,
        num_sample_generations=0, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    if args.min_new_tokens:  # PPOTrainer builds its GenerationConfig inside train(): add the floor there
        generation_config = ppo_module.GenerationConfig
        ppo_module.GenerationConfig = lambda **kwargs: generation_config(**kwargs, min_new_tokens=args.min_new_tokens)
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=reference,
                         reward_model=reward_model, value_model=value_model, train_dataset=dataset)

    marks: dict = {"generate": 0.0, "update_start": None}
    lengths: list[float] = []
    eos = tokenizer.eos_token_id

    original_generation = ppo_module.batch_generation

    def timed_generation(*a, **k):
        start = time.perf_counter()
        try:
            return original_generation(*a, **k)
        finally:
            marks["generate"] += time.perf_counter() - start

    original_forward = ppo_module.forward

    def marking_forward(*a, **k):  # the first forward with grad on is the start of the update
        if torch.is_grad_enabled() and marks["update_start"] is None:
            marks["update_start"] = time.perf_counter()
        return original_forward(*a, **k)

    original_truncate = ppo_module.truncate_response

    def measuring_truncate(stop_token_id, pad_token_id, responses):
        is_eos = responses == eos
        first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, responses.shape[1])
        lengths.extend(first.tolist())  # tokens up to and including the first EOS
        return original_truncate(stop_token_id, pad_token_id, responses)

    ppo_module.batch_generation = timed_generation
    ppo_module.forward = marking_forward
    ppo_module.truncate_response = measuring_truncate

    class StepTimer(TrainerCallback):
        """PPOTrainer calls no on_step_begin: a step runs from the previous step's end (or the train start)."""

        def _start(self):
            marks.update(generate=0.0, update_start=None)
            lengths.clear()
            self.start = time.perf_counter()
            self.cpu_start = time.process_time()

        def on_train_begin(self, *_, **__):
            self._start()

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            update_start = marks["update_start"] or now
            print(json.dumps({
                "step_s": now - self.start, "cpu_s": time.process_time() - self.cpu_start,
                "generate_s": marks["generate"], "score_s": update_start - self.start - marks["generate"],
                "update_s": now - update_start, "completion_length": sum(lengths) / max(len(lengths), 1),
                "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                "load": os.getloadavg()[0]}), flush=True)
            self._start()

    trainer.add_callback(StepTimer())
    trainer.train()


if __name__ == "__main__":
    main()
