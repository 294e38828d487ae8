"""Workload: how much data one RL iteration processes (prompts, samples, lengths, updates)."""

from __future__ import annotations

from dataclasses import dataclass


def _check_positive_int(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One RL iteration's data, in the project's batch vocabulary (DESIGN.md section 5)."""

    prompts_per_step: int
    """Prompts drawn from the dataset for one iteration (the paper's 'batch', 1024 in its runs)."""
    prompt_length: int
    """Tokens per prompt P (prompts are padded to it)."""
    response_length: int
    """Tokens per response T; every response is assumed to run to this length (the paper's setting)."""
    samples_per_prompt: int = 1
    """Responses generated per prompt."""
    mini_batch_size: int = 0
    """Samples per optimizer update; 0 means one update over all the step's samples."""
    ppo_epochs: int = 1
    """Passes over the step's samples during training."""
    micro_batch_tokens: int = 0
    """Per rank: tokens one forward/backward holds; 0 means one sequence (prompt + response)."""
    pad_uneven: bool = False
    """Plan for a system that pads a batch its data-parallel size or generation replica count does not divide
    (each rank then works on ceil(samples / d) rows), e.g. 1024 prompts on the paper's 48-GPU pools.
    hybridflow's trainer splits training and scoring batches evenly: it plans with False and refuses plans
    made with True."""
    actor_log_prob_pass: bool = True
    """Whether the actor's old-log-prob forward runs in the preparation stage (the paper's dataflow). hybridflow's
    trainer skips it where it cannot change the update (``trainers/redundant_passes.py``: one epoch of one
    mini-batch, no KL penalty in the reward) or takes the rollout's log-probs (``actor.loss.old_log_probs:
    rollout``); the planner then costs no such forward."""
    pad_generation: bool = True
    """Allow actor generation layouts whose replica count does not divide the prompts per step: each replica
    generates ceil(prompts / replicas) prompts, the padding rows being repeats whose samples are dropped, while
    every training and scoring split stays even. This is what hybridflow's trainer runs (the generation
    dispatch ``3D_ALL_MICRO_DP`` in ``controller/protocols.py`` pads by repeating rows and drops their samples
    on collect; ``RLConfig.derived`` has no replica rule), hence the default. False restricts the search to
    replica counts that divide the prompts (the planner's behaviour before the trainer accepted padding)."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "prompt_length", "response_length", "samples_per_prompt", "ppo_epochs"):
            _check_positive_int("Workload", name, getattr(self, name))
        for name in ("mini_batch_size", "micro_batch_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Workload.{name} must be an integer >= 0 (0: default), got {value!r}")
        for name in ("pad_uneven", "pad_generation", "actor_log_prob_pass"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Workload.{name} must be True or False, got {getattr(self, name)!r}")
        if self.mini_batch_size and self.num_samples % self.mini_batch_size:
            raise ValueError(f"Workload.mini_batch_size {self.mini_batch_size} must divide prompts_per_step * "
                             f"samples_per_prompt = {self.num_samples}")

    @property
    def num_samples(self) -> int:
        """Sequences per iteration."""
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def sequence_length(self) -> int:
        """S = P + T."""
        return self.prompt_length + self.response_length

    @property
    def samples_per_update(self) -> int:
        return self.mini_batch_size or self.num_samples

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per iteration (mini-batches times epochs)."""
        return self.num_samples // self.samples_per_update * self.ppo_epochs

    @property
    def sequences_per_micro_batch(self) -> int:
        return max(1, (self.micro_batch_tokens or self.sequence_length) // self.sequence_length)
