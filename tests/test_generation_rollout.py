"""The Rollout interface: registry, the native backend's batched call and its requests (per-request options,
finish reasons, abort and continue under newer weights, version stamps)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hybridflow.engine.decoder import DecoderStage
from hybridflow.engine.generation import GenerationEngine, SamplingConfig
from hybridflow.engine.native_rollout import NativeRollout
from hybridflow.engine.rollout import (ROLLOUT_BACKENDS, BackendEntry, GenerationShard, Rollout, RolloutRequest,
                                       SamplingOptions, continue_request, register_rollout, rollout_class,
                                       sampling_options)

PROMPTS = [(5, 9, 17, 33), (40, 41), (7, 7, 8, 99, 120, 3)]


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
    return AutoModelForCausalLM.from_config(config).eval()


def whole_shard(model) -> GenerationShard:
    """The whole model on one process as a generation shard (one piece per parameter, no copy)."""
    weights = {name: [tensor.detach()] for name, tensor in model.state_dict().items()}
    return GenerationShard(weights, layers=range(model.config.num_hidden_layers), has_embedding=True,
                           has_final_norm=True, has_head=True)


def loaded(model, version: int = 1) -> NativeRollout:
    rollout = NativeRollout(model.config, dtype=torch.float32, config=SamplingConfig())
    rollout.load(whole_shard(model), version=version)
    return rollout


def alone(model, prompt, options: SamplingOptions) -> tuple[list[int], list[float]]:
    """The batched engine's response to one prompt under ``options`` (tokens and log-probs up to its end)."""
    fields = {name: getattr(options, name) for name in SamplingOptions.__dataclass_fields__}
    config = SamplingConfig(**fields)
    engine = GenerationEngine(DecoderStage.from_state_dict(model.config, model.state_dict()))
    out = engine.generate(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long), config)
    mask = out["response_mask"][0].bool()
    return out["responses"][0][mask].tolist(), out["logprobs"][0][mask].tolist()


def run_all(rollout: Rollout, requests, **step) -> dict:
    handles = [rollout.submit(request) for request in requests]
    while rollout.pending():
        rollout.step(**step)
    return {handle.request_id: handle.result() for handle in handles}


def test_the_registry_names_the_backends_and_refuses_an_unknown_one():
    assert rollout_class("native") is NativeRollout
    assert tuple(ROLLOUT_BACKENDS)[:2] == ("native", "vllm")
    with pytest.raises(ValueError, match=r"actor.generation.backend must be one of \('native', 'vllm'\), got 'x'"):
        rollout_class("x")


def test_a_registered_backend_is_accepted_by_the_config_and_built_without_editing_the_worker(monkeypatch):
    native = BackendEntry("hybridflow.engine.native_rollout:NativeRollout")
    monkeypatch.setitem(ROLLOUT_BACKENDS, "copy_of_native", native)
    assert SamplingConfig(backend="copy_of_native").backend == "copy_of_native"
    assert rollout_class("copy_of_native") is NativeRollout
    register_rollout("needs_missing", BackendEntry("x:Y", requires="no_such_module_here", install="pip install y"))
    try:
        with pytest.raises(ValueError, match="backend='needs_missing' needs no_such_module_here, which is not "
                                             "installed here: pip install y"):
            SamplingConfig(backend="needs_missing")
    finally:
        del ROLLOUT_BACKENDS["needs_missing"]


def test_the_batched_call_equals_the_generation_engine_and_reports_its_stats():
    model = tiny_model()
    rollout = loaded(model)
    prompts = torch.tensor([[0, 0, 5, 9], [1, 2, 3, 4]])
    mask = (prompts > 0).long()
    config = SamplingConfig(max_new_tokens=5, samples_per_prompt=2, seed=4)
    got = rollout.generate(prompts, mask, config)
    expected = GenerationEngine(DecoderStage.from_state_dict(model.config, model.state_dict())).generate(
        prompts, mask, config)
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    assert rollout.stats.decode_steps == 4 and rollout.stats.kv_cache_bytes > 0 and rollout.logprobs_match_training
    rollout.release()
    with pytest.raises(RuntimeError, match="call load"):
        rollout.generate(prompts, mask, config)


def test_each_request_is_sampled_with_its_own_options_and_ends_for_the_right_reason():
    model = tiny_model()
    greedy = SamplingOptions(max_new_tokens=6, greedy=True)
    first_tokens, _ = alone(model, PROMPTS[0], greedy)
    stop_at = first_tokens[2]  # the third greedy token of prompt 0 becomes its stop token
    requests = [RolloutRequest("stop", PROMPTS[0], dataclasses.replace(greedy, stop_token_ids=(stop_at,))),
                RolloutRequest("length", PROMPTS[1], dataclasses.replace(greedy, max_new_tokens=3)),
                RolloutRequest("sampled", PROMPTS[2], SamplingOptions(max_new_tokens=5, temperature=0.7, top_k=20,
                                                                      seed=11))]
    outputs = run_all(loaded(model, version=3), requests)
    stop = outputs["stop"]
    assert stop.finish_reason == "stop" and stop.token_ids == tuple(first_tokens[:first_tokens.index(stop_at) + 1])
    assert outputs["length"].finish_reason == "length" and len(outputs["length"].token_ids) == 3
    assert list(outputs["length"].token_ids) == alone(model, PROMPTS[1], requests[1].options)[0]
    # a request alone in its group is sampled exactly as the batched call samples it
    tokens, logprobs = alone(model, PROMPTS[2], requests[2].options)
    sampled = outputs["sampled"]
    assert list(sampled.token_ids) == tokens and sampled.finish_reason == "length"
    torch.testing.assert_close(torch.tensor(sampled.logprobs), torch.tensor(logprobs), rtol=0, atol=0)
    assert all(output.versions == (3,) * len(output.token_ids) and output.weight_version == 3
               for output in outputs.values())


def test_a_stop_sequence_completed_across_two_steps_ends_the_request_after_it():
    model = tiny_model()
    greedy = SamplingOptions(max_new_tokens=8, greedy=True)
    tokens, _ = alone(model, PROMPTS[0], greedy)
    options = dataclasses.replace(greedy, stop_sequences=(tuple(tokens[1:3]),))
    output = run_all(loaded(model), [RolloutRequest("r", PROMPTS[0], options)], max_tokens=2)["r"]
    assert output.finish_reason == "stop" and list(output.token_ids) == tokens[:3]
    assert len(output.logprobs) == len(output.versions) == 3


def test_an_aborted_request_continues_under_new_weights_keeping_its_prefix_and_both_versions():
    old_model, new_model = tiny_model(0), tiny_model(1)
    options = SamplingOptions(max_new_tokens=7, greedy=True)
    rollout = loaded(old_model, version=1)
    handle = rollout.submit(RolloutRequest("episode-0", PROMPTS[0], options))
    assert rollout.step(max_tokens=3) == [] and not handle.done()
    rollout.abort("episode-0")
    partial = handle.result()
    old_tokens, old_logprobs = alone(old_model, PROMPTS[0], options)
    assert partial.finish_reason == "abort" and list(partial.token_ids) == old_tokens[:3]
    assert partial.versions == (1, 1, 1)
    # the same tokens' log-probs, computed with a cache of another length (rounding only)
    torch.testing.assert_close(torch.tensor(partial.logprobs), torch.tensor(old_logprobs[:3]), rtol=0, atol=1e-5)

    rollout.release()
    rollout.load(whole_shard(new_model), version=2)
    final = asyncio.run(rollout.generate_requests([continue_request(partial)], tokens_per_step=2))[0]
    assert final.finish_reason == "length" and len(final.token_ids) == 7
    assert final.token_ids[:3] == partial.token_ids and final.logprobs[:3] == partial.logprobs
    assert final.versions == (1, 1, 1, 2, 2, 2, 2) and final.weight_version == 2
    # the new tokens are the new weights' greedy continuation of prompt + partial response
    continued, _ = alone(new_model, PROMPTS[0] + partial.token_ids, dataclasses.replace(options, max_new_tokens=4))
    assert list(final.token_ids[3:]) == continued
    with pytest.raises(ValueError, match="only an aborted request can be continued"):
        continue_request(final)


def test_an_asynchronous_caller_aborts_one_request_while_the_others_run_on():
    model = tiny_model()
    rollout = loaded(model)
    options = SamplingOptions(max_new_tokens=6, greedy=True)
    requests = [RolloutRequest(f"r{i}", prompt, options) for i, prompt in enumerate(PROMPTS)]

    async def main():
        running = asyncio.ensure_future(rollout.generate_requests(requests, tokens_per_step=1))
        await asyncio.sleep(0)  # one step done
        rollout.abort("r1")
        return await running

    outputs = asyncio.run(main())
    assert [output.finish_reason for output in outputs] == ["length", "abort", "length"]
    assert 1 <= len(outputs[1].token_ids) < 6
    for prompt, output in zip(PROMPTS, outputs):
        assert list(output.token_ids) == alone(model, prompt, options)[0][:len(output.token_ids)]


def test_sampling_options_come_from_the_actors_config_and_a_backend_without_requests_says_so():
    config = SamplingConfig(max_new_tokens=9, temperature=0.5, eos_token_ids=(2,), pad_token_id=1, seed=4)
    options = sampling_options(config, seed=7)
    assert (options.max_new_tokens, options.temperature, options.eos_token_ids, options.pad_token_id,
            options.seed) == (9, 0.5, (2,), 1, 7)
    # the base class's answer, what a backend without request methods of its own gives (no engine needed)
    bare = object.__new__(NativeRollout)
    with pytest.raises(NotImplementedError, match="the 'native' rollout backend does not implement submit"):
        Rollout.submit(bare, RolloutRequest("r", (1, 2), options))
    # the registry says which backends serve requests (multi-turn episodes need one)
    assert ROLLOUT_BACKENDS["native"].requests and ROLLOUT_BACKENDS["vllm"].requests
    assert not BackendEntry("x:Y").requests
