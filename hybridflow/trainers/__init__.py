"""Driver programs: RL training (PPO, GRPO, RLOO, ReMax, REINFORCE++), SFT, reward-model training, the demo.

Import from the submodules (``hybridflow.trainers.rl.RLTrainer``, ``hybridflow.trainers.config.load_rl_config``,
``hybridflow.trainers.supervised.run_supervised``); this package imports nothing heavy by itself.
"""
