"""``micro_batch_tokens: auto``: the memory-sized budget, its estimate, and engines that plan with it alike."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
from hybridflow.engine import token_budget
from hybridflow.engine.token_budget import activation_bytes_per_token, auto_token_budget, resumed_token_budget
from hybridflow.models import build_tiny_model
from hybridflow.parallel.launch import run_distributed

ROWS, PROMPT_LEN, RESPONSE_LEN = 6, 5, 4
MIB = 2**20


class Width256:
    """The shape benchmarks/bench_activation_memory.py measured (161 KB per token in fp32)."""

    hidden_size, intermediate_size, num_hidden_layers, vocab_size = 256, 768, 4, 4096


def make_batch(rows: int = ROWS, prompt_len: int = PROMPT_LEN) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (rows, prompt_len + RESPONSE_LEN), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # one shorter row
    return dict(input_ids=ids, attention_mask=mask, responses=ids[:, -RESPONSE_LEN:],
                response_mask=mask[:, -RESPONSE_LEN:])


def nll_loss(outputs, micro_batch):
    mask = micro_batch["response_mask"]
    return -(outputs["logprobs"] * mask).sum() / micro_batch["num_tokens_global"], {}


def engine_with(budget, **layout) -> TrainingEngine:
    config = EngineConfig(micro_batch_tokens=budget, dtype="float32", optim=OptimConfig(lr=1e-3), **layout)
    return TrainingEngine(config, build_tiny_model)


# ------------------------------------------------------------------ the arithmetic
def test_auto_budget_is_half_the_free_memory_over_the_per_token_cost_rounded_down():
    assert auto_token_budget(1000, 20 * MIB) == (10 * MIB // 1000) // 256 * 256  # 10485 -> 10240
    assert auto_token_budget(1000, 20 * MIB, pending_bytes=10 * MIB) == 5120
    assert auto_token_budget(1000, 1 * MIB) == token_budget.AUTO_MIN_TOKENS  # the floor
    assert auto_token_budget(1000, 1 << 40) == token_budget.AUTO_MAX_TOKENS  # the ceiling
    assert auto_token_budget(1000, 1 << 40, pipeline=True) == token_budget.AUTO_PIPELINE_MAX_TOKENS
    with pytest.raises(ValueError, match="bytes_per_token must be > 0, got 0"):
        auto_token_budget(0, MIB)


def test_activation_estimate_matches_its_calibration_and_orders_the_modes():
    full = activation_bytes_per_token(Width256, compute_dtype=torch.float32, trainable=True)
    # 4 layers x (12 x 256 + 6 x 768) x 4 bytes + 3 fp32 values per vocabulary entry: 172 KB, measured 161 KB
    assert full == 4 * (12 * 256 + 6 * 768) * 4 + 3 * 4 * 4096 == 172032
    checkpointed = activation_bytes_per_token(Width256, compute_dtype=torch.float32, trainable=True,
                                              activation_checkpointing=True)
    inference = activation_bytes_per_token(Width256, compute_dtype=torch.float32, trainable=False)
    assert inference < checkpointed < full
    assert activation_bytes_per_token(Width256, compute_dtype=torch.bfloat16, trainable=True) < full
    assert activation_bytes_per_token(Width256, compute_dtype=torch.float32, trainable=True, tp_size=2) < full
    assert activation_bytes_per_token(Width256, compute_dtype=torch.float32, trainable=True, pp_size=2) < full
    value_head = activation_bytes_per_token(Width256, compute_dtype=torch.float32, trainable=True, lm_head=False)
    assert full - value_head == 3 * 4 * 4096


# ------------------------------------------------------------------ the engine
def test_auto_engine_resolves_once_from_free_memory_and_counts_the_optimizer_state_not_yet_allocated(monkeypatch):
    monkeypatch.setattr(token_budget, "free_memory_bytes", lambda device: 40 * MIB)
    engine = engine_with("auto")
    per_token = activation_bytes_per_token(engine.hf_config, compute_dtype=torch.float32, trainable=True)
    moments_and_grads = 12 * sum(p.numel() for p in engine.params)
    expected = auto_token_budget(per_token, 40 * MIB, pending_bytes=moments_and_grads)
    engine.train_step(make_batch(), nll_loss)
    assert engine.last_batch_stats["token_budget"] == engine.token_budget == expected
    monkeypatch.setattr(token_budget, "free_memory_bytes", lambda device: 1 << 40)
    engine.forward(make_batch())
    assert engine.last_batch_stats["token_budget"] == expected  # resolved at the first batch, then kept


def test_auto_engine_runs_rows_longer_than_a_small_budget_and_matches_that_fixed_budget(monkeypatch):
    monkeypatch.setattr(token_budget, "free_memory_bytes", lambda device: 0)  # the floor: 512 tokens
    long_rows = make_batch(prompt_len=716)  # rows of 720 tokens (one of 718), longer than the budget
    auto = engine_with("auto")
    fixed = engine_with(720)  # the same plan, given explicitly: one row per micro-batch
    metrics_auto = auto.train_step(long_rows, nll_loss)
    metrics_fixed = fixed.train_step(long_rows, nll_loss)
    assert auto.last_batch_stats["token_budget"] == 720
    assert auto.last_batch_stats["micro_batches"] == fixed.last_batch_stats["micro_batches"] == ROWS
    assert metrics_auto["loss"] == pytest.approx(metrics_fixed["loss"], rel=1e-6)
    for mine, theirs in zip(auto.params, fixed.params):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"more than micro_batch_tokens=512"):
        engine_with(512).train_step(long_rows, nll_loss)  # a fixed budget still refuses


def test_a_resumed_run_keeps_its_checkpoints_budget_while_that_fits():
    assert resumed_token_budget(None, 4096) == 4096  # no record (a checkpoint written before it, a new run)
    assert resumed_token_budget(6144, 4096) == 6144  # more than this process's own budget, within its free memory
    assert resumed_token_budget(2048, 4096) == 2048  # more memory free now: the run goes on as it was
    assert resumed_token_budget(8192, 4096) == 8192  # exactly all the free memory the fresh budget was sized from
    assert resumed_token_budget(8448, 4096) == 4096  # past it: a smaller machine sizes its own
    assert resumed_token_budget(6144, 4096, pipeline=True) == 4096  # never past the pipeline's ceiling
    assert resumed_token_budget(3072, 4096, pipeline=True) == 3072


def test_an_engine_restores_the_auto_budget_its_checkpoint_recorded(monkeypatch, tmp_path):
    monkeypatch.setattr(token_budget, "free_memory_bytes", lambda device: 200 * MIB)
    first = engine_with("auto")
    first.train_step(make_batch(), nll_loss)
    recorded = first.token_budget
    first.save_checkpoint(str(tmp_path / "ckpt"))
    assert json.loads((tmp_path / "ckpt" / "engine.json").read_text())["token_budget"] == recorded

    # the host's free memory moved a little: a new run would size another budget, the resumed one keeps its own
    monkeypatch.setattr(token_budget, "free_memory_bytes", lambda device: 220 * MIB)
    assert engine_with("auto")._resolve_auto_budget() != recorded
    resumed = engine_with("auto")
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    resumed.save_checkpoint(str(tmp_path / "again"))  # saved before its first batch: the record carries on
    assert json.loads((tmp_path / "again" / "engine.json").read_text())["token_budget"] == recorded
    resumed.train_step(make_batch(), nll_loss)
    assert resumed.last_batch_stats["token_budget"] == recorded

    # a machine whose free memory cannot hold the recorded budget's activations sizes its own
    monkeypatch.setattr(token_budget, "free_memory_bytes", lambda device: 40 * MIB)
    smaller = engine_with("auto")
    smaller.load_checkpoint(str(tmp_path / "ckpt"))
    smaller.train_step(make_batch(), nll_loss)
    assert smaller.token_budget < recorded

    fixed = engine_with(64)  # a fixed budget is the config's, whatever the checkpoint recorded
    fixed.load_checkpoint(str(tmp_path / "ckpt"))
    assert fixed.token_budget == 64
    fixed.save_checkpoint(str(tmp_path / "fixed"))
    assert json.loads((tmp_path / "fixed" / "engine.json").read_text())["token_budget"] is None


def _budgets_of_ranks_with_different_free_memory(rank: int, world_size: int) -> tuple[int, int, int]:
    free = (rank + 1) * 16 * MIB
    token_budget.free_memory_bytes = lambda device: free
    # tensor-parallel ranks run every micro-batch together: they must plan the same ones
    engine = TrainingEngine(EngineConfig(micro_batch_tokens="auto", dtype="float32", layout="3d", tp_size=2),
                            build_tiny_model)
    per_token = activation_bytes_per_token(engine.hf_config, compute_dtype=torch.float32, trainable=True, tp_size=2)
    own = auto_token_budget(per_token, free, pending_bytes=12 * sum(p.to_local().numel() for p in engine.params))
    engine.train_step(make_batch(64, prompt_len=60), nll_loss)
    return own, engine.token_budget, engine.last_batch_stats["micro_batches"]


def test_ranks_with_different_free_memory_agree_on_the_smallest_budget():
    (own0, budget0, count0), (own1, budget1, count1) = run_distributed(
        _budgets_of_ranks_with_different_free_memory, 2)
    assert own0 < own1  # each rank alone would have planned differently
    assert budget0 == budget1 == own0
    assert count0 == count1 > 1
