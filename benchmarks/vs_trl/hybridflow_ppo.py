"""hybridflow's side of PPO: the RL trainer at its default settings on the shared assets.

The config states only the workload: PPO (``advantage_estimator: gae``, KL in the reward, the
default k1 estimator), the policy and reference from ``--model-dir``, the critic and the reward
model from ``--score-dir``, batch sizes, lengths, learning rate (the critic's set to the actor's, as
TRL trains policy and value with one optimizer) and the KL coefficient; no performance knob. Prints
one JSON line per step, like trl_ppo.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

from side_args import side_parser


def main() -> None:
    args = side_parser(score_model=True, runtime=True).parse_args()

    sys.path.insert(0, str(Path(__file__).parent))
    from hybridflow_grpo import run_trainer

    from hybridflow.trainers.config.rl import load_rl_config

    samples = args.prompts_per_step * args.samples_per_prompt
    config = load_rl_config(None, [
        # the prompt file's raw text, as TRL feeds a plain "prompt" field (it templates only chat rows)
        f"data.train_path={args.prompts}", "data.chat_template=never", f"actor.model.path={args.model_dir}",
        f"reward.model={{path: {args.score_dir}}}", f"critic.model={{path: {args.score_dir}}}",
        "algorithm.advantage_estimator=gae", "algorithm.kl_mode=reward", f"algorithm.kl_coef={args.kl_coef}",
        f"actor.generation.max_new_tokens={args.max_new_tokens}",
        f"actor.generation.min_new_tokens={args.min_new_tokens}", "actor.generation.temperature=1.0",
        f"actor.engine.optim.lr={args.lr}", f"critic.engine.optim.lr={args.lr}",
        f"batch.prompts_per_step={args.prompts_per_step}", f"batch.samples_per_prompt={args.samples_per_prompt}",
        f"batch.mini_batch_size={samples}", f"trainer.total_steps={args.steps}", "trainer.progress_bar=false",
        f"trainer.output_dir={args.output_dir}", "trainer.overwrite=true", *args.set])
    run_trainer(config, runtime=args.runtime)


if __name__ == "__main__":
    main()
