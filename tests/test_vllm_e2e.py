"""End to end with ``actor.generation.backend: vllm``: the reduced built-in demo and two GRPO steps on SmolLM2.

Slow (each run starts a vLLM engine, 20-70 s on a loaded 2-core machine); skipped where vLLM is not installed.
Both run in local mode (every role inside the test process), as the demo and the SmolLM2 example do by default.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from hybridflow.models import smollm2_path  # noqa: E402

from smollm2_example import run_two_grpo_steps  # noqa: E402
# vLLM's KV cache for these runs: small models, short sequences (the default 1 GiB would only cost memory)
# recompute: the old-log-prob forward runs (a GRPO step of one mini-batch would skip it), so the rollout/training
# mismatch is measured
VLLM = ["actor.generation.backend=vllm", "actor.generation.vllm_kv_cache_gib=0.125", "actor.loss.old_log_probs=recompute"]
# fp32 on both sides: the rollout's log-probs and the training engine's differ by rounding only
LOGPROB_TOLERANCE = 1e-3


def _fp32_bytes(model_dir: Path) -> int:
    """Bytes of a checkpoint's tensors held in fp32 (what one tg = 1 vLLM engine receives per update)."""
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as checkpoint:
            for name in checkpoint.keys():
                total += 4 * math.prod(checkpoint.get_slice(name).get_shape())
    return total


def _assert_vllm_rollout_metrics(record: dict, *, model_dir: Path) -> None:
    model_bytes = _fp32_bytes(model_dir)
    assert record["rollout/vllm_bytes_loaded"] == model_bytes  # the whole model, copied in once per step
    # the KV cache asked for, rounded down to whole vLLM blocks
    assert 0.9 * 0.125 * 2**30 < record["rollout/vllm_kv_cache_bytes"] <= 0.125 * 2**30
    assert record["time/rollout_vllm_load_s"] > 0
    # during generation the rank holds its training copy and vLLM's copy of the weights, whose embedding and
    # head vLLM pads to a multiple of 64 rows
    hidden_size = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    padding_bytes = 2 * 63 * hidden_size * 4
    assert 2 * model_bytes <= record["rollout/generation_param_bytes"] <= 2 * model_bytes + padding_bytes
    assert 0 <= record["rollout/logprob_abs_diff_mean"] <= record["rollout/logprob_abs_diff_max"] < LOGPROB_TOLERANCE
    assert abs(record["rollout/sequence_kl"]) < LOGPROB_TOLERANCE


@pytest.mark.slow
def test_the_reduced_demo_runs_every_stage_with_vllm_generating_the_ppo_rollouts(tmp_path, monkeypatch):
    from hybridflow.trainers.config import rl as rl_config
    from hybridflow.trainers.demo import DemoConfig, run_demo

    from test_demo import SMALL

    load_rl_config = rl_config.load_rl_config

    def load_with_vllm(path, overrides):  # the demo's PPO stage builds its RL config through this function
        return load_rl_config(path, [*overrides, *VLLM])

    monkeypatch.setattr(rl_config, "load_rl_config", load_with_vllm)
    summary = run_demo(DemoConfig(output_dir=str(tmp_path), **SMALL), tensorboard=False)
    records = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2]
    assert summary["ppo_accuracy"] == records[-1]["val/function_mean"]
    assert summary["reward_last_step"] == records[-1]["reward/score_mean"]
    for key in ("sft_accuracy", "ppo_accuracy", "best_ppo_accuracy", "rm_val_accuracy"):
        assert 0.0 <= summary[key] <= 1.0
    for record in records:
        _assert_vllm_rollout_metrics(record, model_dir=tmp_path / "sft" / "model")
        assert 1 <= record["response/length_mean"] <= 5  # the demo's MAX_RESPONSE_TOKENS


@pytest.mark.slow
@pytest.mark.needs_smollm2
def test_two_grpo_steps_on_smollm2_run_with_vllm_generating_the_rollouts(tmp_path):
    history = run_two_grpo_steps(tmp_path, max_new_tokens=16, overrides=VLLM, num_train=4, num_eval=2,
                                 problems="arithmetic")
    assert [record["step"] for record in history] == [1, 2]
    for record in history:
        assert 1 <= record["response/length_mean"] <= 16
        assert 0.0 <= record["reward/score_mean"] <= 1.0
        assert record["actor/lr"] > 0 and record["actor/grad_norm"] >= 0
        _assert_vllm_rollout_metrics(record, model_dir=Path(smollm2_path()))
