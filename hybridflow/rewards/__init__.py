"""Rewards: the `module:function` plug-in interface, weighted combinations, built-in math and sandboxed code rewards."""

from hybridflow.rewards.code import code_reward, extract_code
from hybridflow.rewards.math_answer import answers_match, extract_final_answer, math_reward, parse_number
from hybridflow.rewards.plugin import (
    BUILTIN_REWARDS,
    RewardError,
    RewardMix,
    RuleReward,
    combine_scores,
    load_reward_function,
)
from hybridflow.rewards.sandbox import SandboxConfig, SandboxResult, SandboxUnavailableError, run_python

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardMix",
    "RuleReward",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailableError",
    "answers_match",
    "code_reward",
    "combine_scores",
    "extract_code",
    "extract_final_answer",
    "load_reward_function",
    "math_reward",
    "parse_number",
    "run_python",
]
