"""Generation engine: parity with Hugging Face, sampling features, early-finish compaction, validation."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from hybridflow.engine.decoder import DecoderStage
from hybridflow.engine.generation import GenerationEngine, SamplingConfig, draw_tokens

P, T = 6, 8


def tiny_model(family: str = "llama"):
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
    config = {"llama": lambda: LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
              "qwen2": lambda: Qwen2Config(**common, tie_word_embeddings=True),
              "mistral": lambda: MistralConfig(**common, sliding_window=None),
              "llama3_rope": lambda: LlamaConfig(**common, rope_parameters={
                  "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})}[family]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def engine_for(model) -> GenerationEngine:
    return GenerationEngine(DecoderStage.from_state_dict(model.config, model.state_dict()))


def batch(rows: int = 4):
    generator = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 256, (rows, P), generator=generator)
    mask = torch.ones_like(prompts)
    mask[0, :3] = 0
    mask[rows - 1, :1] = 0
    return prompts * mask, mask


def hf_logprobs(model, out, temperature: float = 1.0) -> torch.Tensor:
    """log p(responses[:, t] | before) recomputed by a plain Hugging Face forward, [B, T]."""
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits
    logits_BTV = logits[:, P - 1:-1].float() / temperature
    return torch.log_softmax(logits_BTV, -1).gather(-1, out["responses"][..., None]).squeeze(-1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "llama3_rope"])
def test_greedy_responses_equal_hf_generate_and_logprobs_equal_an_hf_forward(family):
    assert_greedy_equals_hf(tiny_model(family))


def assert_greedy_equals_hf(model) -> None:
    """Greedy responses equal HF generate's and their log-probs an HF forward's."""
    prompts, mask = batch()
    out = engine_for(model).generate(prompts, mask, SamplingConfig(max_new_tokens=T, greedy=True))
    with torch.no_grad():
        expected = model.generate(prompts, attention_mask=mask, max_new_tokens=T, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)[:, P:]
    assert torch.equal(out["responses"], expected)
    torch.testing.assert_close(out["logprobs"], hf_logprobs(model, out), atol=1e-5, rtol=0)


def test_sampled_logprobs_at_temperature_one_equal_an_hf_forward_of_the_same_sequences():
    model = tiny_model()
    prompts, mask = batch()
    out = engine_for(model).generate(prompts, mask, SamplingConfig(max_new_tokens=T, seed=7))
    torch.testing.assert_close(out["logprobs"], hf_logprobs(model, out), atol=1e-5, rtol=0)


def test_logprobs_at_other_temperatures_come_from_the_tempered_untruncated_distribution():
    model = tiny_model()
    prompts, mask = batch()
    config = SamplingConfig(max_new_tokens=T, temperature=0.7, top_k=20, seed=7)
    out = engine_for(model).generate(prompts, mask, config)
    torch.testing.assert_close(out["logprobs"], hf_logprobs(model, out, temperature=0.7), atol=1e-5, rtol=0)


def test_output_follows_the_shared_batch_conventions():
    model = tiny_model()
    prompts, mask = batch()
    out = engine_for(model).generate(prompts, mask, SamplingConfig(max_new_tokens=T, greedy=True))
    assert out["responses"].shape == (4, T) and out["input_ids"].shape == (4, P + T)
    assert torch.equal(out["input_ids"][:, -T:], out["responses"])
    assert torch.equal(out["prompts"], prompts)
    assert torch.equal(out["attention_mask"], torch.cat([mask, out["response_mask"]], dim=1))
    assert torch.equal(out["position_ids"], (out["attention_mask"].cumsum(1) - 1).clamp(min=0))


def test_outputs_decoded_under_inference_mode_are_ordinary_tensors_training_can_use():
    model = tiny_model()
    prompts, mask = batch()
    out = engine_for(model).generate(prompts, mask, SamplingConfig(max_new_tokens=4, seed=0))
    assert not any(value.is_inference() for value in out.values())
    weight = torch.ones((), requires_grad=True)
    (weight * out["logprobs"]).sum().backward()  # saving an inference tensor for backward would raise here
    assert weight.grad == out["logprobs"].sum()
    out["response_mask"][:, -1] = 0  # so would an in-place update outside inference mode


def test_same_seed_reproduces_samples_and_another_seed_changes_them():
    engine = engine_for(tiny_model())
    prompts, mask = batch()
    first = engine.generate(prompts, mask, SamplingConfig(max_new_tokens=T, seed=11))["responses"]
    again = engine.generate(prompts, mask, SamplingConfig(max_new_tokens=T, seed=11))["responses"]
    other = engine.generate(prompts, mask, SamplingConfig(max_new_tokens=T, seed=12))["responses"]
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_top_k_one_and_a_tiny_top_p_both_reduce_to_greedy():
    engine = engine_for(tiny_model())
    prompts, mask = batch()
    greedy = engine.generate(prompts, mask, SamplingConfig(max_new_tokens=T, greedy=True))["responses"]
    top_k = engine.generate(prompts, mask, SamplingConfig(max_new_tokens=T, top_k=1, seed=5))["responses"]
    top_p = engine.generate(prompts, mask, SamplingConfig(max_new_tokens=T, top_p=1e-6, seed=5))["responses"]
    assert torch.equal(top_k, greedy) and torch.equal(top_p, greedy)


def test_top_k_samples_only_among_the_k_most_likely_tokens():
    model = tiny_model()
    prompts, mask = batch()
    out = engine_for(model).generate(prompts, mask, SamplingConfig(max_new_tokens=T, top_k=3, seed=2))
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits[:, P - 1:-1]
    chosen = logits.gather(-1, out["responses"][..., None])
    rank_of_chosen = (logits > chosen).sum(-1)
    assert int(rank_of_chosen.max()) <= 2


def test_top_p_samples_only_inside_the_nucleus():
    model = tiny_model()
    prompts, mask = batch()
    out = engine_for(model).generate(prompts, mask, SamplingConfig(max_new_tokens=T, top_p=0.5, seed=2))
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits[:, P - 1:-1]
    probs = logits.float().softmax(-1)
    chosen = probs.gather(-1, out["responses"][..., None]).squeeze(-1)
    mass_above = (probs * (probs > chosen[..., None])).sum(-1)
    assert bool((mass_above < 0.5 + 1e-6).all())


def test_drawn_tokens_follow_each_rows_distribution_and_never_a_zero_probability_token():
    # row 0: four tokens with unequal mass among zeros; row 1: all mass on the last token; row 2: on the first;
    # row 3: a 49k vocabulary of tiny masses with two heavy tokens (the cumsum's rounding at SmolLM2's size)
    V = 49152
    probs = torch.zeros(4, V)
    probs[0, [5, 6, 900, V - 2]] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    probs[1, V - 1] = 1.0
    probs[2, 0] = 1.0
    probs[3] = 1e-6
    probs[3, [7, V // 2]] = 0.25
    probs[3, 11] = 0.0
    generator = torch.Generator().manual_seed(0)
    draws = 20000
    counts = torch.zeros(4, V)
    for _ in range(draws // 100):
        tokens = torch.stack([draw_tokens(probs, generator) for _ in range(100)])
        counts.scatter_add_(1, tokens.T, torch.ones(4, 100))
    assert bool((counts[probs == 0] == 0).all())
    assert counts[1, V - 1] == draws and counts[2, 0] == draws
    expected = probs / probs.sum(-1, keepdim=True)
    for row, token in [(0, 5), (0, 6), (0, 900), (0, V - 2), (3, 7), (3, V // 2)]:
        p = float(expected[row, token])
        sd = (p * (1 - p) / draws) ** 0.5
        assert abs(float(counts[row, token]) / draws - p) < 5 * sd, (row, token)
    # the 49k small tokens of row 3 together: their mass, and spread over the vocabulary (not piled at one end)
    small = counts[3].clone()
    small[[7, V // 2]] = 0
    p_small = 1 - float(expected[3, 7] + expected[3, V // 2])
    assert abs(float(small.sum()) / draws - p_small) < 5 * (p_small * (1 - p_small) / draws) ** 0.5
    first_half = float(small[:V // 2].sum()) / float(small.sum())
    assert 0.4 < first_half < 0.6


def test_drawing_is_reproducible_from_the_generator():
    probs = torch.rand(8, 300).softmax(-1)
    first = draw_tokens(probs, torch.Generator().manual_seed(4))
    again = draw_tokens(probs, torch.Generator().manual_seed(4))
    other = torch.stack([draw_tokens(probs, torch.Generator().manual_seed(5)) for _ in range(3)])
    assert torch.equal(first, again) and not bool((other == first).all())


def test_eos_and_stop_tokens_end_responses_and_finished_rows_stop_costing_compute():
    engine = engine_for(tiny_model())
    prompts, mask = batch()
    greedy = engine.generate(prompts, mask, SamplingConfig(max_new_tokens=T, greedy=True))["responses"]
    eos, stop = int(greedy[0, 2]), int(greedy[1, 4])
    config = SamplingConfig(max_new_tokens=T, greedy=True, eos_token_ids=(eos,), stop_token_ids=(stop,),
                              pad_token_id=0)
    out = engine.generate(prompts, mask, config)
    lengths = []
    for row in range(4):
        hits = [t for t in range(T) if int(greedy[row, t]) in (eos, stop)]
        length = hits[0] + 1 if hits else T
        lengths.append(length)
        assert torch.equal(out["responses"][row, :length], greedy[row, :length])
        assert bool((out["responses"][row, length:] == 0).all())
        assert out["response_mask"][row].tolist() == [1] * length + [0] * (T - length)
        assert bool((out["logprobs"][row, length:] == 0).all())
    assert lengths[0] <= 3 and lengths[1] <= 5
    stats = engine.last_stats
    # a row of length L is fed back L-1 times; rows that finished are cut out of the batch and cache
    assert stats.rows_decoded == sum(length - 1 for length in lengths)
    assert stats.decode_steps == max(lengths) - 1


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.01], ids=["every end", "half the rows", "never"])
def test_finished_rows_leave_the_batch_once_they_are_the_compact_fraction_and_outputs_do_not_change(fraction,
                                                                                                  monkeypatch):
    import hybridflow.engine.generation as generation

    engine = engine_for(tiny_model())
    prompts, mask = batch(rows=8)
    greedy = engine.generate(prompts, mask, SamplingConfig(max_new_tokens=T, greedy=True))["responses"]
    config = SamplingConfig(max_new_tokens=T, greedy=True, eos_token_ids=(int(greedy[0, 1]),), pad_token_id=0)
    monkeypatch.setattr(generation, "COMPACT_FRACTION", 0.0)
    every_end = engine.generate(prompts, mask, config)
    lengths = every_end["response_mask"].sum(-1).tolist()
    assert 1 < len(set(lengths))  # rows end at different steps
    monkeypatch.setattr(generation, "COMPACT_FRACTION", fraction)
    out = engine.generate(prompts, mask, config)
    for key in ("responses", "response_mask", "input_ids", "attention_mask"):
        assert torch.equal(out[key], every_end[key]), key
    # the same tokens; their log-probs only to float rounding (a matmul over another number of rows may
    # sum in another order)
    torch.testing.assert_close(out["logprobs"], every_end["logprobs"], rtol=0, atol=1e-5)
    stats = engine.last_stats
    # replay the rule: rows that ended stay in the batch (decoded, ignored) until they are `fraction` of it
    expected, batch_rows, ended = 0, 8, 0
    for step in range(stats.decode_steps):
        ended += sum(1 for length in lengths if length == step + 1)
        if ended and ended >= fraction * batch_rows:
            batch_rows, ended = batch_rows - ended, 0
        expected += batch_rows
    assert stats.rows_decoded == expected
    assert stats.decode_steps == max(lengths) - 1


def test_samples_per_prompt_are_prompt_major_and_differ_between_samples():
    engine = engine_for(tiny_model())
    prompts, mask = batch(2)
    out = engine.generate(prompts, mask, SamplingConfig(max_new_tokens=T, samples_per_prompt=3, seed=1))
    assert out["responses"].shape == (6, T)
    assert torch.equal(out["prompts"], prompts.repeat_interleave(3, dim=0))
    assert len({tuple(r) for r in out["responses"][:3].tolist()}) > 1


def test_kv_cache_is_released_when_generation_returns():
    engine = engine_for(tiny_model())
    caches = []
    original = engine.stage.new_cache

    def tracking_new_cache(**kwargs):
        cache = original(**kwargs)
        caches.append(weakref.ref(cache))
        return cache

    engine.stage.new_cache = tracking_new_cache
    prompts, mask = batch()
    engine.generate(prompts, mask, SamplingConfig(max_new_tokens=T, greedy=True))
    gc.collect()
    assert len(caches) == 1 and caches[0]() is None
    # keys and values of 2 layers, 4 rows, 2 kv heads, P+T positions, head dim 16, fp32
    assert engine.last_stats.kv_cache_bytes == 2 * 2 * 4 * 2 * (P + T) * 16 * 4


@pytest.mark.parametrize("field, value", [("max_new_tokens", 0), ("temperature", 0.0), ("top_k", -1),
                                          ("top_p", 0.0), ("top_p", 1.5), ("samples_per_prompt", 0),
                                          ("eos_token_ids", [2]), ("stop_token_ids", (-1,))])
def test_invalid_generation_configs_are_rejected_with_the_field_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**{field: value})


def test_sliding_window_attention_is_refused_rather_than_silently_ignored():
    from hybridflow.engine.decoder import DecoderSpec

    with pytest.raises(ValueError, match="sliding_window"):
        DecoderSpec.from_hf(MistralConfig(sliding_window=16))


def test_a_memory_budget_admits_rows_in_waves_with_the_same_greedy_output():
    model = tiny_model()
    engine = engine_for(model)
    prompts, mask = batch(rows=5)
    config = SamplingConfig(max_new_tokens=T, greedy=True, samples_per_prompt=2)
    whole = engine.generate(prompts, mask, config)
    assert engine.last_stats.waves == 1  # on CPU an unset budget admits every row at once
    per_row = engine.stage.bytes_per_row(P, T)
    budget_gib = 3.5 * per_row / 2**30  # three rows per wave: 10 rows in 4 waves
    assert engine.rows_per_wave(10, P, SamplingConfig(max_new_tokens=T, memory_budget_gib=budget_gib)) == 3
    waved = engine.generate(prompts, mask, SamplingConfig(max_new_tokens=T, greedy=True, samples_per_prompt=2,
                                                            memory_budget_gib=budget_gib))
    assert engine.last_stats.waves == 4
    assert set(waved) == set(whole)
    for key in whole:
        if whole[key].is_floating_point():  # batch-size-dependent rounding of the matmuls
            torch.testing.assert_close(waved[key], whole[key], rtol=0, atol=1e-5)
        else:
            assert torch.equal(waved[key], whole[key]), key


def test_sampling_in_waves_is_reproducible_for_a_given_budget_and_a_bad_budget_is_refused():
    engine = engine_for(tiny_model())
    prompts, mask = batch(rows=4)
    config = SamplingConfig(max_new_tokens=T, seed=5, memory_budget_gib=2 * engine.stage.bytes_per_row(P, T) / 2**30)
    first, second = engine.generate(prompts, mask, config), engine.generate(prompts, mask, config)
    assert engine.last_stats.waves == 2
    assert torch.equal(first["responses"], second["responses"])
    with pytest.raises(ValueError, match="memory_budget_gib must be a number > 0 or null"):
        SamplingConfig(memory_budget_gib=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_decode_without_compaction_equals_the_compacting_decode(family):
    # static shapes (finished rows stay in the batch, the cache is written at a device-side index)
    # are what CUDA graphs replay on GPUs; on CPU they must give the same responses
    model = tiny_model(family)
    compacting = engine_for(model)
    static = GenerationEngine(DecoderStage.from_state_dict(model.config, model.state_dict()), static_decode=True)
    assert not compacting.static_decode and not static.cuda_graphs  # CPU defaults: compaction, no graphs
    prompts, mask = batch()
    greedy = compacting.generate(prompts, mask, SamplingConfig(max_new_tokens=T, greedy=True))["responses"]
    eos, stop = int(greedy[0, 2]), int(greedy[1, 4])
    config = SamplingConfig(max_new_tokens=T, greedy=True, eos_token_ids=(eos,), stop_token_ids=(stop,),
                              samples_per_prompt=2)
    want, got = compacting.generate(prompts, mask, config), static.generate(prompts, mask, config)
    for key in want:
        if want[key].is_floating_point():
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-5)
        else:
            assert torch.equal(got[key], want[key]), key
    # every row is computed at every step until all have finished (checked every few steps)
    assert static.last_stats.rows_decoded == 8 * static.last_stats.decode_steps
    assert static.last_stats.decode_steps <= T - 1


def test_cuda_graphs_are_refused_without_static_decode_on_a_cuda_device():
    stage = DecoderStage.from_state_dict(tiny_model().config, tiny_model().state_dict())
    with pytest.raises(ValueError, match="cuda_graphs needs static_decode on a CUDA device"):
        GenerationEngine(stage, static_decode=True, cuda_graphs=True)


@pytest.mark.parametrize("rows", [1, 7, 256, 300])
def test_decoder_projections_equal_f_linear_in_either_form_and_return_row_major_results(rows):
    from hybridflow.engine import decoder

    generator = torch.Generator().manual_seed(rows)
    x_RK = torch.randn(rows, 512, generator=generator)
    weight_NK = torch.randn(600, 512, generator=generator)  # 307,200 elements: feature-major for few rows
    head_VK = torch.randn(2 * decoder.HEAD_CHUNK_ROWS + 5, 512, generator=generator)
    projected = decoder.project(x_RK.view(rows, 1, 512), weight_NK)
    assert projected.shape == (rows, 1, 600) and projected.is_contiguous()
    torch.testing.assert_close(projected, torch.nn.functional.linear(x_RK, weight_NK).view(rows, 1, 600),
                               atol=1e-4, rtol=1e-5)
    logits = decoder.head_logits(x_RK, head_VK)
    assert logits.is_contiguous()
    torch.testing.assert_close(logits, torch.nn.functional.linear(x_RK, head_VK), atol=1e-4, rtol=1e-5)
    few_rows = rows <= decoder.FEATURE_MAJOR_MAX_ROWS
    assert decoder._feature_major(x_RK, weight_NK) == few_rows
    assert not decoder._feature_major(x_RK, weight_NK[:100])  # a small weight keeps F.linear
    assert not decoder._feature_major(x_RK.double(), weight_NK.double())  # measured in fp32 only


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_decode_through_the_feature_major_projections_still_equals_hf(family, monkeypatch):
    from hybridflow.engine import decoder

    monkeypatch.setattr(decoder, "FEATURE_MAJOR_MIN_WEIGHT", 0)  # every projection of the tiny model takes it
    assert_greedy_equals_hf(tiny_model(family))


@pytest.mark.parametrize("kv_heads,queries", [(3, 1), (1, 1), (3, 5)])
def test_cpu_half_precision_attention_as_grouped_matmuls_equals_fp32_sdpa(kv_heads, queries):
    """bf16 on CPU skips SDPA's slow kernel for two grouped matmuls: the same attention up to bf16 rounding."""
    from hybridflow.engine.decoder import attention

    generator = torch.Generator().manual_seed(kv_heads * 10 + queries)
    B, N, L, D = 4, 9 if kv_heads == 3 else 2, 12, 16
    q = torch.randn(B, N, queries, D, generator=generator)
    keys, values = torch.randn(B, kv_heads, L, D, generator=generator), torch.randn(B, kv_heads, L, D, generator=generator)
    mask = torch.rand(B, 1, queries, L, generator=generator) > 0.3
    mask[..., L - queries:] |= torch.eye(queries, dtype=torch.bool)  # every query sees itself, as the decoder's do
    reference = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=D ** -0.5,
                                                                 enable_gqa=N != kv_heads)
    fp32 = attention(q, keys, values, mask, D ** -0.5)
    torch.testing.assert_close(fp32, reference)  # fp32 keeps SDPA
    half = attention(q.bfloat16(), keys.bfloat16(), values.bfloat16(), mask, D ** -0.5)
    assert half.dtype == torch.bfloat16 and half.shape == reference.shape
    torch.testing.assert_close(half.float(), reference, atol=0.05, rtol=0.05)
    # masked keys get no weight at all: changing them changes nothing
    poisoned = values.bfloat16().masked_fill(~mask[:, :, -1, :, None].expand(B, kv_heads, L, D), 1e4)
    if queries == 1:
        torch.testing.assert_close(attention(q.bfloat16(), keys.bfloat16(), poisoned, mask, D ** -0.5), half)


def test_bf16_greedy_decode_mostly_agrees_with_fp32_and_its_logprobs_are_close():
    model = tiny_model()
    prompts = torch.randint(3, model.config.vocab_size, (6, 5), generator=torch.Generator().manual_seed(3))
    config = SamplingConfig(max_new_tokens=8, greedy=True)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        state = {name: tensor.to(dtype) for name, tensor in model.state_dict().items()}
        out[dtype] = GenerationEngine(DecoderStage.from_state_dict(model.config, state)).generate(
            prompts, torch.ones_like(prompts), config)
    fp32, bf16 = out[torch.float32], out[torch.bfloat16]
    # the prefill's token (position 0) and the first decoded one (position 1), where the rows still agree
    agree_BT = (fp32["responses"] == bf16["responses"]).long().cumprod(1).bool()[:, :2]
    assert agree_BT[:, 0].float().mean() >= 0.8 and agree_BT[:, 1].any()
    gap = (fp32["logprobs"][:, :2] - bf16["logprobs"][:, :2]).abs()[agree_BT]
    assert gap.max() < 0.1
