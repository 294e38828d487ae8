"""Single-process behaviour of the training engine: exact packing, micro-batch independence,
inference outputs against plain Hugging Face forwards, LR schedule, configuration and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
from hybridflow.engine.micro_batch import default_position_ids, pack_rows, padding_ratio, plan_micro_batches
from hybridflow.engine.optim import lr_at
from hybridflow.models import ModelConfig, build_model, build_tiny_model
from hybridflow.parallel.pipeline import packed_attention_bias

ROWS, PROMPT_LEN, RESPONSE_LEN = 6, 7, 5


def make_batch(seed: int = 3) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (ROWS, PROMPT_LEN + RESPONSE_LEN), generator=generator)
    mask = torch.ones_like(ids)
    lefts, rights = [0, 3, 5, 1, 0, 6], [0, 2, 4, 0, 1, 3]
    for row, (left, right) in enumerate(zip(lefts, rights)):
        mask[row, :left] = 0
        if right:
            mask[row, -right:] = 0
    return dict(input_ids=ids, attention_mask=mask, responses=ids[:, -RESPONSE_LEN:],
                response_mask=mask[:, -RESPONSE_LEN:])


def hf_response_logprobs(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """log p(responses) from a plain padded HF forward (of softmax(logits / temperature)), 0 on response padding."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=default_position_ids(mask)).logits
    logprobs = torch.log_softmax(logits[:, :-1].float() / temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return logprobs[:, -RESPONSE_LEN:] * batch["response_mask"]


def nll_loss(outputs, micro_batch):
    mask = micro_batch["response_mask"]
    return -(outputs["logprobs"] * mask).sum() / micro_batch["num_tokens_global"], {}


def tiny_engine(micro_batch_tokens: int = 4096, head: str = "lm", total_steps: int | None = None,
                **optim) -> TrainingEngine:
    # fp32 compute: these tests compare with an fp32 reference to rounding (auto is bf16 on GPUs)
    config = EngineConfig(micro_batch_tokens=micro_batch_tokens, dtype="float32",
                          optim=OptimConfig(**{"lr": 1e-3, "eps": 1e-4, **optim}))
    return TrainingEngine(config, lambda: build_tiny_model(head=head), head=head, total_steps=total_steps)


# ------------------------------------------------------------------ micro-batching
def test_plan_keeps_each_micro_batch_within_the_budget_and_every_row_once():
    lengths = torch.tensor([9, 3, 7, 2, 5, 5, 8, 1])
    plans = plan_micro_batches(lengths, token_budget=10)
    assert sorted(row for plan in plans for row in plan) == list(range(8))
    assert all(int(lengths[plan].sum()) <= 10 for plan in plans)
    assert len(plans) == math.ceil(int(lengths.sum()) / 10)  # 40 tokens fit exactly in 4 bins here


def test_plan_never_splits_a_group_of_consecutive_rows():
    lengths = torch.tensor([4, 4, 1, 1, 3, 3, 2, 2])
    plans = plan_micro_batches(lengths, token_budget=8, group_size=2)
    for plan in plans:
        for row in plan:
            assert (row ^ 1) in plan  # rows 2k and 2k+1 travel together


def test_plan_splits_bins_to_reach_a_minimum_count():
    plans = plan_micro_batches(torch.tensor([2, 2, 2, 2]), token_budget=100, min_count=3)
    assert len(plans) == 3 and sorted(r for p in plans for r in p) == [0, 1, 2, 3]


def test_group_longer_than_the_budget_is_a_value_error_naming_both():
    with pytest.raises(ValueError, match=r"holds 9 real tokens, more than micro_batch_tokens=8"):
        plan_micro_batches(torch.tensor([9, 1]), token_budget=8)


def test_packed_mask_lets_each_token_see_only_its_own_sequence_prefix():
    bias = packed_attention_bias(torch.tensor([[0, 1, 2, 0, 1, 0]]), torch.float32)[0, 0]
    allowed = bias == 0
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def test_packing_removes_all_padding_of_a_skewed_batch():
    batch = make_batch()
    mask = batch["attention_mask"]
    packed = pack_rows(list(range(ROWS)), batch["input_ids"], mask, default_position_ids(mask))
    assert packed.num_real_tokens == int(mask.sum()) == packed.packed_length
    assert padding_ratio(packed.num_real_tokens, packed.packed_length) == 0.0
    assert padding_ratio(int(mask.sum()), mask.numel()) == pytest.approx(25 / 72)  # 15 left + 10 right pads


# ------------------------------------------------------------------ inference
@pytest.mark.parametrize("family, budget", [("llama", 12), ("llama", 4096), ("qwen2", 12), ("mistral", 12)])
def test_forward_logprobs_equal_a_plain_hugging_face_forward(family, budget):
    batch = make_batch()
    engine = TrainingEngine(EngineConfig(micro_batch_tokens=budget, dtype="float32"), lambda: build_tiny_model(family))
    outputs = engine.forward(batch)
    torch.testing.assert_close(outputs["logprobs"], hf_response_logprobs(build_tiny_model(family), batch),
                               rtol=0, atol=2e-6)
    assert outputs["entropy"].shape == (ROWS, RESPONSE_LEN)
    assert float(outputs["entropy"][batch["response_mask"].bool()].min()) > 0


def test_forward_and_train_step_use_the_tempered_distribution_the_rollout_sampled_from():
    batch = make_batch()
    engine = tiny_engine(micro_batch_tokens=12)
    model = build_tiny_model()
    tempered = engine.forward(batch, outputs=("logprobs",), temperature=0.7)["logprobs"]
    torch.testing.assert_close(tempered, hf_response_logprobs(model, batch, temperature=0.7), rtol=0, atol=2e-6)
    plain = engine.forward(batch, outputs=("logprobs",))["logprobs"]
    assert float((tempered - plain).abs().max()) > 1e-2  # not the temperature-1 numbers
    seen = {}

    def record(outputs, micro_batch):
        seen.setdefault("logprobs", []).append(outputs["logprobs"].detach())
        return nll_loss(outputs, micro_batch)

    engine.train_step(batch, record, outputs=("logprobs",), temperature=0.7)
    # one micro-batch per row here (budget 12): the update's log-probs are the forward's, row by row
    rows = torch.cat(seen["logprobs"]).cpu()  # the loss sees them on the engine's device, forward returns CPU
    assert rows.shape == tempered.shape
    torch.testing.assert_close(rows.sort(0).values, tempered.sort(0).values, rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        engine.forward(batch, outputs=("logprobs",), temperature=0)


def test_value_and_score_heads_read_the_state_before_each_response_token_and_the_last_token():
    batch = make_batch()
    engine = tiny_engine(head="value")
    values = engine.forward(batch, outputs=("values",))["values"]
    model = build_tiny_model(head="value")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        per_token = model(input_ids=ids, attention_mask=mask, position_ids=default_position_ids(mask)).logits[..., 0]
    want_values = per_token[:, -RESPONSE_LEN - 1:-1] * batch["response_mask"]
    torch.testing.assert_close(values, want_values, rtol=0, atol=2e-6)
    score_engine = tiny_engine(head="score")
    scores = score_engine.forward(batch, outputs=("scores",))["scores"]
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)
    torch.testing.assert_close(scores, per_token[torch.arange(ROWS), last], rtol=0, atol=2e-6)


def test_a_row_without_real_tokens_is_a_value_error_naming_it():
    batch = make_batch()
    batch["attention_mask"][4] = 0
    with pytest.raises(ValueError, match=r"batch rows \[4\] have no real tokens"):
        tiny_engine().forward(batch)


def test_outputs_the_head_cannot_give_are_a_value_error():
    with pytest.raises(ValueError, match=r"not available from head 'lm'; allowed: \('logprobs', 'entropy'\)"):
        tiny_engine().forward(make_batch(), outputs=("values",))


# ------------------------------------------------------------------ training
def test_micro_batch_budgets_that_split_the_batch_differently_give_the_same_step():
    batch = make_batch()
    small, large = tiny_engine(12), tiny_engine(4096)
    for _ in range(2):
        loss_small = small.train_step(batch, nll_loss)["loss"]
        loss_large = large.train_step(batch, nll_loss)["loss"]
        assert loss_small == pytest.approx(loss_large, rel=1e-6)
    for (name, a), b in zip(small.model.named_parameters(), large.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_the_lm_head_runs_only_where_a_response_token_is_predicted_and_the_step_is_unchanged(monkeypatch):
    batch = make_batch()
    engine, reference = tiny_engine(), tiny_engine()
    seen: list[int] = []
    forward = type(engine.model).forward

    def counting_forward(module, tokens, positions, head_positions_K=None):
        out = forward(module, tokens, positions, head_positions_K)
        seen.append(out.shape[1])
        return out

    monkeypatch.setattr(type(engine.model), "forward", counting_forward)
    monkeypatch.setattr(reference, "_head_positions", lambda packed, num_columns: None)  # the whole sequence
    loss = engine.train_step(batch, nll_loss)["loss"]
    assert seen == [int(batch["response_mask"].sum())]  # one micro-batch: the head ran on the response tokens
    assert loss == pytest.approx(reference.train_step(batch, nll_loss)["loss"], rel=1e-6)
    for (name, a), b in zip(engine.model.named_parameters(), reference.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def pairwise_reward_loss(outputs, micro_batch):
    """Bradley-Terry loss of (chosen, rejected) pairs in consecutive rows, mean over all pairs."""
    scores = outputs["scores"]
    pair_losses = -torch.nn.functional.logsigmoid(scores[0::2] - scores[1::2])
    return pair_losses.sum() / (micro_batch["num_sequences_global"] / 2), {}


def test_reward_pairs_kept_together_give_the_same_step_for_any_budget():
    batch = make_batch()
    small, large = tiny_engine(20, head="score", lr=1e-2), tiny_engine(4096, head="score", lr=1e-2)
    loss_small = small.train_step(batch, pairwise_reward_loss, group_size=2)
    loss_large = large.train_step(batch, pairwise_reward_loss, group_size=2)
    assert small.last_batch_stats["micro_batches"] == 3 and large.last_batch_stats["micro_batches"] == 1
    assert loss_small["loss"] == pytest.approx(loss_large["loss"], rel=1e-6)
    for (name, a), b in zip(small.model.named_parameters(), large.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_one_step_changes_every_parameter_and_lowers_the_loss_on_the_same_batch():
    batch = make_batch()
    engine = tiny_engine(lr=1e-2)
    before = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    first = engine.train_step(batch, nll_loss)
    second = engine.train_step(batch, nll_loss)
    assert second["loss"] < first["loss"]
    for name, param in engine.model.named_parameters():
        assert not torch.equal(param, before[name]), name
    assert engine.step == 2 and first["lr"] == pytest.approx(1e-2)


def test_gradient_clipping_reports_the_norm_before_clipping_and_bounds_the_update():
    batch = make_batch()
    clipped = TrainingEngine(EngineConfig(dtype="float32", optim=OptimConfig(lr=1.0, grad_clip=1e-3, eps=1e30)),
                             lambda: build_tiny_model())
    before = {n: p.detach().clone() for n, p in clipped.model.named_parameters()}
    # with a huge eps Adam's step is lr * m / eps ~ 0, so check the clipped gradient the optimizer sees
    # (the engine frees gradients right after the step)
    seen, step = [], clipped.optimizer.step
    clipped.optimizer.step = lambda: (seen.append([p.grad.clone() for p in clipped.model.parameters()]), step())
    metrics = clipped.train_step(batch, nll_loss)
    assert metrics["grad_norm"] > 1e-3
    total = torch.sqrt(sum(g.double().pow(2).sum() for g in seen[0]))
    assert float(total) == pytest.approx(1e-3, rel=1e-3)
    assert all(torch.allclose(p, before[n], atol=1e-20) for n, p in clipped.model.named_parameters())


def test_learning_rate_schedules_follow_warmup_then_decay():
    linear = OptimConfig(lr=1.0, lr_schedule="linear", warmup_steps=1)
    assert [lr_at(s, linear, 5) for s in range(6)] == pytest.approx([0.5, 1.0, 0.75, 0.5, 0.25, 0.0])
    cosine = OptimConfig(lr=2.0, lr_schedule="cosine")
    assert [lr_at(s, cosine, 4) for s in range(5)] == pytest.approx([2.0, 1 + 2 ** -0.5, 1.0, 1 - 2 ** -0.5, 0.0])


def test_save_then_load_continues_training_identically(tmp_path):
    batch = make_batch()
    engine = tiny_engine(lr_schedule="linear", warmup_steps=1, total_steps=3)
    engine.train_step(batch, nll_loss)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    continued = [engine.train_step(batch, nll_loss)["loss"] for _ in range(2)]
    resumed = tiny_engine(lr_schedule="linear", warmup_steps=1, total_steps=3)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.step == 1
    assert [resumed.train_step(batch, nll_loss)["loss"] for _ in range(2)] == continued
    for (name, a), b in zip(engine.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_saving_over_a_checkpoint_replaces_it_and_leaves_no_temporary_directory(tmp_path):
    engine = tiny_engine()
    target = tmp_path / "ckpt"
    engine.save_checkpoint(str(target))
    engine.train_step(make_batch(), nll_loss)
    engine.save_checkpoint(str(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert '"step": 1' in (target / "engine.json").read_text()


def test_export_with_tied_embeddings_reproduces_logits_after_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    engine = TrainingEngine(EngineConfig(dtype="float32", optim=OptimConfig(lr=1e-2)),
                            lambda: build_tiny_model(tie_word_embeddings=True))
    batch = make_batch()
    engine.train_step(batch, nll_loss)
    engine.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(hf_response_logprobs(exported, batch), engine.forward(batch)["logprobs"],
                               rtol=0, atol=2e-6)


# ------------------------------------------------------------------ configuration and bad input
def test_tp_size_not_dividing_the_heads_is_a_value_error_naming_allowed_sizes():
    with pytest.raises(ValueError, match=r"tp_size 3 does not divide .*allowed tp sizes for this model: \[1, 2\]"):
        TrainingEngine(EngineConfig(layout="3d", tp_size=3), lambda: build_tiny_model())


def test_pp_size_larger_than_the_layers_is_a_value_error():
    with pytest.raises(ValueError, match=r"pp_size 5 is larger than the model's 4 layers; allowed: 1..4"):
        TrainingEngine(EngineConfig(layout="3d", pp_size=5), lambda: build_tiny_model())


def test_world_size_not_divisible_by_model_parallel_size_is_a_value_error():
    with pytest.raises(ValueError, match=r"world_size 1 is not divisible by pp_size\*tp_size = 1\*2"):
        TrainingEngine(EngineConfig(layout="3d", tp_size=2), lambda: build_tiny_model())


def test_unsupported_architecture_is_a_value_error_naming_the_supported_families():
    from transformers import GPT2Config, GPT2LMHeadModel

    tiny_gpt2 = lambda: GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match=r"'gpt2' .* not supported yet; "
                                         r"supported: llama, mistral, qwen2, qwen3, qwen3_moe, gemma3_text$"):
        TrainingEngine(EngineConfig(), tiny_gpt2)


def test_missing_model_directory_is_a_value_error_naming_the_path(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError, match="does not exist"):
        TrainingEngine(EngineConfig(), lambda: build_model(ModelConfig(path=missing)))


def test_loading_from_a_directory_without_a_checkpoint_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="has no engine.json"):
        tiny_engine().load_checkpoint(str(tmp_path))


def test_loading_a_checkpoint_of_another_head_is_a_value_error(tmp_path):
    tiny_engine(head="value").save_checkpoint(str(tmp_path / "critic"))
    with pytest.raises(ValueError, match=r"holds a head='value' model; this engine has head='lm'"):
        tiny_engine().load_checkpoint(str(tmp_path / "critic"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(layout="megatron"), r"engine.layout must be one of \('fsdp', '3d'\), got 'megatron'"),
    (dict(layout="fsdp", tp_size=2), r"must be 1 with layout='fsdp'"),
    (dict(micro_batch_tokens=0), r"engine.micro_batch_tokens must be a positive integer or 'auto', got 0"),
    (dict(micro_batch_tokens="big"), r"engine.micro_batch_tokens must be a positive integer or 'auto', got 'big'"),
    (dict(dtype="fp8"), r"engine.dtype must be one of"),
    (dict(layout="3d", fsdp_cpu_offload=True), r"fsdp_cpu_offload=True needs layout='fsdp'"),
    (dict(pipeline_schedule="zb"), r"engine.pipeline_schedule must be one of \('1f1b', 'gpipe'\)"),
])
def test_engine_config_rejects_bad_values_naming_field_given_and_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=0), r"optim.lr must be a finite number > 0, got 0"),
    (dict(betas=(0.9, 1.0)), r"optim.betas must be two numbers in \[0, 1\)"),
    (dict(lr_schedule="step"), r"optim.lr_schedule must be one of"),
])
def test_optim_config_rejects_bad_values_naming_field_given_and_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(**kwargs)


def test_a_schedule_longer_in_warmup_than_the_run_is_refused_naming_both_counts():
    with pytest.raises(ValueError, match=r"optim.warmup_steps 5 exceeds the run's 2 optimizer steps; allowed: 0..2"):
        OptimConfig(warmup_steps=5).check_schedule(2)
    with pytest.raises(ValueError, match=r"total_steps must be a positive integer, got 0"):
        OptimConfig().check_schedule(0)
    OptimConfig(warmup_steps=5).check_schedule(5)
    OptimConfig(warmup_steps=5).check_schedule(None)  # constant: the run's length does not matter


def test_gradients_are_freed_right_after_the_optimizer_step():
    engine = tiny_engine()
    engine.train_step(make_batch(), nll_loss)
    assert all(param.grad is None for param in engine.model.parameters())
    assert engine.optimizer.state  # the step itself ran: Adam holds its moments


def test_the_fused_adamw_makes_the_default_adamw_update_to_rounding():
    from hybridflow.engine.optim import build_optimizer

    config = OptimConfig(lr=1e-2, weight_decay=0.1)
    models = [torch.nn.Linear(8, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    initial = models[0].weight.detach().clone()
    fused = build_optimizer(models[0], config, total_steps=None)
    default = torch.optim.AdamW(models[1].parameters(), lr=config.lr, betas=config.betas, eps=config.eps,
                                weight_decay=config.weight_decay)
    assert fused.param_groups[0]["fused"] and not default.param_groups[0]["fused"]
    inputs = torch.randn(16, 8)
    for _ in range(3):
        for model, optimizer in zip(models, (fused, default)):
            optimizer.zero_grad()
            model(inputs).square().mean().backward()
            optimizer.step()
    for ours, reference in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-7)
    assert not torch.equal(models[0].weight, initial)  # the steps moved the weights


def test_a_decaying_schedule_without_total_steps_is_refused_when_the_optimizer_is_built():
    from hybridflow.engine.optim import build_optimizer

    config = OptimConfig(lr_schedule="cosine")  # the run's step count is the trainer's, so the config is valid
    with pytest.raises(ValueError, match=r"optim.lr_schedule='cosine' needs the run's optimizer step count"):
        build_optimizer(torch.nn.Linear(2, 2), config, total_steps=None)
