"""The vLLM rollout backend against the native engine, on one vLLM engine shared by the whole test session.

Skipped where vLLM is not installed. vLLM's engine takes tens of seconds to start, so every test here uses
the session's one actor with ``backend: vllm`` (its engine is built on the first rollout and kept).
"""

from __future__ import annotations

import dataclasses
import itertools
import resource

import pytest
import torch

pytest.importorskip("vllm")

from hybridflow.controller.local import init_local_process_group  # noqa: E402
from hybridflow.data import PromptDataset  # noqa: E402
from hybridflow.data.builtin import ArithmeticTaskConfig, builtin_tokenizer, prompt_rows  # noqa: E402
from hybridflow.engine import EngineConfig, OptimConfig  # noqa: E402
from hybridflow.engine.generation import GenerationConfig  # noqa: E402
from hybridflow.engine.generation_config import GenerationTokens  # noqa: E402
from hybridflow.models.config import ModelConfig  # noqa: E402
from hybridflow.trainers.build import model_config_of  # noqa: E402
from hybridflow.workers import ActorSpec, ActorWorker, EngineSpec  # noqa: E402
from hybridflow.workers.actor import next_token_loss_fn  # noqa: E402
from hybridflow.workers.base import SEQUENCE_KEYS, tensors_of  # noqa: E402

TOKENIZER = builtin_tokenizer()


def _actor(backend: str) -> ActorWorker:
    engine = EngineSpec(model=model_config_of(ModelConfig(builtin="arithmetic")), head="lm", seed=0,
                        engine=EngineConfig(dtype="float32", optim=OptimConfig(lr=1e-2)))
    generation = GenerationConfig(backend=backend, max_new_tokens=6, greedy=True, vllm_kv_cache_gib=0.0625)
    tokens = GenerationTokens(eos_token_ids=(TOKENIZER.eos_token_id,), pad_token_id=TOKENIZER.pad_token_id)
    return ActorWorker(ActorSpec(engine=engine, generation=generation, tokens=tokens))


@pytest.fixture(scope="session")
def actors():
    """(native actor, vLLM actor): the same built-in model, seed and optimizer, in this process."""
    init_local_process_group()
    return _actor("native"), _actor("vllm")


def _prompts(count: int, seed: int = 0):
    rows = prompt_rows(count, split="train", seed=seed, config=ArithmeticTaskConfig(max_digits=2))
    return PromptDataset(rows, TOKENIZER, max_prompt_tokens=16).batch(range(count))


def _full_weights(actor: ActorWorker) -> dict[str, list[torch.Tensor]]:
    return {name: [tensor.detach()] for name, tensor in actor.engine.local_shards().items()}


def test_backend_vllm_with_generation_pipeline_stages_is_refused_naming_the_key():
    from hybridflow.trainers.config.rl import load_rl_config

    overrides = ["data.train_path=unused.jsonl", "actor.model.builtin=arithmetic", "reward.function=arithmetic",
                 "actor.engine.layout=3d", "actor.generation.backend=vllm", "placement.pools.global=[2]"]
    with pytest.raises(ValueError, match=r"hybrid_engine.pp_size got 2; allowed: 1 with actor.generation.backend=vllm"):
        load_rl_config(None, [*overrides, "actor.engine.pp_size=2", "actor.hybrid_engine.pp_size=2"])
    # tensor-parallel generation is accepted (tests/test_vllm_tp.py runs it)
    config = load_rl_config(None, [*overrides, "actor.engine.tp_size=2", "actor.hybrid_engine.tp_size=2"])
    assert config.actor.hybrid_engine.tp_size == 2


def test_greedy_tokens_from_vllm_equal_the_native_engines_in_fp32(actors):
    native, vllm = actors
    prompts = _prompts(6)
    expected, got = native.generate_sequences(prompts), vllm.generate_sequences(prompts)
    for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(expected.batch[key], got.batch[key]), key
    mask_BT = got.batch["response_mask"].bool()
    torch.testing.assert_close(got.batch["logprobs"][mask_BT], expected.batch["logprobs"][mask_BT],
                               rtol=1e-4, atol=1e-4)
    stats = vllm.transition_stats()
    model_bytes = sum(t.numel() * 4 for t in vllm.engine.local_shards().values())
    assert stats["vllm_bytes_loaded"] == model_bytes  # tg = 1: the whole model, copied in once
    assert stats["vllm_load_s"] > 0 and stats["vllm_kv_cache_bytes"] == 0.0625 * 2**30
    assert vllm.rollout.resident_bytes() == 0  # released for training after the rollout


def test_after_a_training_step_vllm_generates_with_the_new_weights(actors):
    native, vllm = actors
    prompts = _prompts(4, seed=1)
    before = vllm.generate_sequences(prompts)
    batch = tensors_of(native.generate_sequences(prompts), SEQUENCE_KEYS)
    for actor in (native, vllm):  # the same next-token step on both: identical new weights
        actor.engine.train_step(batch, next_token_loss_fn(1.0), outputs=("logprobs",))
    after_native, after_vllm = native.generate_sequences(prompts), vllm.generate_sequences(prompts)
    mask_BT = after_vllm.batch["response_mask"].bool()
    assert torch.equal(after_vllm.batch["responses"], after_native.batch["responses"])
    torch.testing.assert_close(after_vllm.batch["logprobs"][mask_BT], after_native.batch["logprobs"][mask_BT],
                               rtol=1e-4, atol=1e-4)
    # the step moved the model: the first response token's log-prob changed in every row
    assert not torch.allclose(before.batch["logprobs"][:, 0], after_vllm.batch["logprobs"][:, 0])


def test_sampling_options_hold_in_vllm(actors):
    _, vllm = actors
    rollout = vllm.rollout
    prompts = _prompts(4, seed=2)
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    rollout.load_weights(_full_weights(vllm))
    try:
        base = dataclasses.replace(vllm.actor_spec.generation.for_call(vllm.actor_spec.tokens, seed=5,
                                                                       samples_per_prompt=3),
                                   greedy=False, temperature=1.0, max_new_tokens=6)
        sampled = rollout.generate(ids, mask, base)
        again = rollout.generate(ids, mask, base)
        assert sampled["responses"].shape == (12, 6)
        assert torch.equal(sampled["prompts"][0::3], ids)  # prompt-major rows
        assert torch.equal(sampled["responses"], again["responses"])  # same seed, same responses
        end = TOKENIZER.eos_token_id
        banned = int(sampled["responses"][0, 0])
        shaped = rollout.generate(ids, mask, dataclasses.replace(base, suppress_tokens=(banned,), min_new_tokens=3))
        real_BT = shaped["response_mask"].bool()
        assert not (shaped["responses"][real_BT] == banned).any()
        assert not (shaped["responses"][:, :3] == end).any() and bool(real_BT[:, :3].all())
        greedy = rollout.generate(ids, mask, dataclasses.replace(base, greedy=True, samples_per_prompt=1))
        row0 = greedy["responses"][0].tolist()
        stop = row0[1]
        ends = row0.index(stop) + 1  # the stop token ends the response at its first occurrence and is kept
        stopped = rollout.generate(ids, mask, dataclasses.replace(base, greedy=True, samples_per_prompt=1,
                                                                   stop_token_ids=(stop,)))
        assert stopped["responses"][0, :ends].tolist() == row0[:ends]
        assert stopped["response_mask"][0].tolist() == [1] * ends + [0] * (6 - ends)
        row1 = greedy["responses"][1].tolist()
        two = tuple(row1[1:3])
        ends = next(end for end in range(2, 7) if tuple(row1[end - 2:end]) == two)
        cut = rollout.generate(ids, mask, dataclasses.replace(base, greedy=True, samples_per_prompt=1,
                                                               stop_sequences=(two,)))
        assert cut["responses"][1, :ends].tolist() == row1[:ends]
        assert cut["response_mask"][1].tolist() == [1] * ends + [0] * (6 - ends)
    finally:
        rollout.release()


def test_twenty_update_generate_round_trips_do_not_grow_memory(actors):
    _, vllm = actors
    prompts = _prompts(4, seed=3)

    def round_trip():
        vllm.generate_sequences(prompts)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    for _ in range(3):  # allocator and vLLM warm-up
        round_trip()
    start = round_trip()
    for _ in range(20):
        peak = round_trip()
    # the KV cache (64 MiB) and the weights are released and re-grown every time: no growth beyond noise
    assert peak - start < 32 * 2**20


def test_generation_is_right_whatever_the_regrown_kv_cache_and_weight_storage_held(actors, monkeypatch):
    """Released storage comes back holding whatever the allocator hands out: zeros while glibc maps fresh pages,
    old bytes once it reuses its heap (HYBRIDFLOW_HOST_ALLOCATOR=keep). Fill it with NaN bytes before the
    rollout sees it: the responses and log-probs must still equal the native engine's."""
    from hybridflow.engine.vllm_rollout import VllmRollout

    native, vllm = actors
    vllm.generate_sequences(_prompts(2, seed=4))  # the rollout exists and has released its storage
    assert vllm.rollout._released or vllm.rollout.sleeps
    if vllm.rollout.sleeps:
        pytest.skip("vLLM's sleep mode reallocates on wake-up (CUDA): the regrow path is the CPU build's")
    reacquire = VllmRollout._reacquire

    def reacquire_into_garbage(self):
        for storage, nbytes in self._released.values():
            storage.resize_(nbytes)
            torch.empty(0, dtype=torch.uint8).set_(storage).fill_(0xFF)  # every float32 is NaN
        reacquire(self)

    monkeypatch.setattr(VllmRollout, "_reacquire", reacquire_into_garbage)
    for seed in (5, 6):  # the second round reuses storage that held NaN and then one rollout's KV entries
        prompts = _prompts(6, seed=seed)
        expected, got = native.generate_sequences(prompts), vllm.generate_sequences(prompts)
        mask_BT = got.batch["response_mask"].bool()
        assert torch.equal(got.batch["responses"], expected.batch["responses"])
        torch.testing.assert_close(got.batch["logprobs"][mask_BT], expected.batch["logprobs"][mask_BT],
                                   rtol=1e-4, atol=1e-4)


def _request_outputs(actor: ActorWorker, prompts, options) -> dict:
    """Greedy requests for the prompts' rows on the actor's rollout (prompt 0 aborted after two engine steps and
    continued), run inside one rollout lifecycle."""
    from hybridflow.engine.rollout import RolloutRequest, continue_request

    rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompts.batch["input_ids"], prompts.batch["attention_mask"])]

    def produce(rollout):
        handles = [rollout.submit(RolloutRequest(f"r{index}", tuple(row), options)) for index, row in enumerate(rows)]
        rollout.step(max_tokens=2)
        rollout.abort("r0")
        aborted = handles[0].result()
        resumed = rollout.submit(continue_request(aborted, request_id="r0-resumed"))
        while rollout.pending():
            rollout.step(max_tokens=3)
        return {"aborted": aborted, "resumed": resumed.result(), **{h.request_id: h.result() for h in handles[1:]}}

    config = actor._call_config(prompts.meta_info)
    output, _, _, _ = actor._rollout(prompts, config, produce)
    return output


def test_requests_on_vllm_batch_continuously_abort_continue_and_equal_the_native_requests(actors):
    from hybridflow.engine.rollout import SamplingOptions

    native, vllm = actors
    prompts = _prompts(3, seed=3)
    options = SamplingOptions(max_new_tokens=6, greedy=True, eos_token_ids=(TOKENIZER.eos_token_id,),
                              pad_token_id=TOKENIZER.pad_token_id)
    expected, got = _request_outputs(native, prompts, options), _request_outputs(vllm, prompts, options)
    assert got["aborted"].finish_reason == "abort" and 1 <= len(got["aborted"].token_ids) < 6
    assert got["resumed"].token_ids[:len(got["aborted"].token_ids)] == got["aborted"].token_ids
    for name in ("resumed", "r1", "r2"):
        assert got[name].token_ids == expected[name].token_ids, name
        assert got[name].finish_reason == expected[name].finish_reason
        torch.testing.assert_close(torch.tensor(got[name].logprobs), torch.tensor(expected[name].logprobs),
                                   rtol=1e-4, atol=1e-4)
        assert set(got[name].versions) == {vllm.engine.step}
    assert vllm.rollout.pending() == 0 and vllm.rollout.resident_bytes() == 0


def _perturbed(weights: dict[str, list[torch.Tensor]], seed: int) -> dict[str, list[torch.Tensor]]:
    """``weights`` with noise of half each matrix's standard deviation added (vectors kept): another policy."""
    generator = torch.Generator().manual_seed(seed)
    return {name: [piece + 0.5 * piece.std() * torch.randn(piece.shape, generator=generator) if piece.dim() > 1
                   else piece for piece in pieces] for name, pieces in weights.items()}


def _load(rollout, weights: dict[str, list[torch.Tensor]], *, version: int, hf_config) -> None:
    from hybridflow.engine.rollout import GenerationShard

    rollout.load(GenerationShard(weights, layers=range(hf_config.num_hidden_layers), has_embedding=True,
                                 has_final_norm=True, has_head=True), version=version)


def _run(rollout, requests, *, loads: dict[int, tuple[dict, int]], hf_config, tokens_per_step: int = 1):
    """Submit ``requests`` and step ``tokens_per_step`` tokens at a time until all finish, loading
    ``loads[i] = (weights, version)`` after the i-th step; the outputs by request id."""
    handles = [rollout.submit(request) for request in requests]
    steps = 0
    while rollout.pending():
        rollout.step(max_tokens=tokens_per_step)
        steps += 1
        if steps in loads:
            weights, version = loads[steps]
            _load(rollout, weights, version=version, hf_config=hf_config)
    return {handle.request_id: handle.result() for handle in handles}


def test_weights_loaded_between_vllm_steps_continue_the_requests_in_flight_with_the_new_weights(actors):
    """In-flight weights (``async.mode: streaming``): requests keep their tokens across a load; every later token
    is the new policy's from the prompt and those tokens (its keys and values recomputed, no old ones reused), as
    a fresh request with the new weights given the same prefix generates it; each token carries its version."""
    from hybridflow.engine.rollout import RolloutRequest, SamplingOptions

    _, vllm = actors
    if vllm.rollout is None:  # the engine is built by the first rollout
        vllm.generate_sequences(_prompts(1))
    rollout = vllm.rollout
    hf_config = rollout.hf_config
    old = _full_weights(vllm)
    new = _perturbed(old, seed=11)
    prompts = _prompts(3, seed=7)
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompts.batch["input_ids"], prompts.batch["attention_mask"])]
    greedy = SamplingOptions(max_new_tokens=8, greedy=True, pad_token_id=TOKENIZER.pad_token_id)
    try:
        _load(rollout, old, version=0, hf_config=hf_config)
        requests = [RolloutRequest(f"g{index}", tuple(row), greedy) for index, row in enumerate(rows)]
        spanning = _run(rollout, requests, loads={3: (new, 1)}, hf_config=hf_config)
        _load(rollout, old, version=0, hf_config=hf_config)
        only_old = _run(rollout, [RolloutRequest(f"old-{r.request_id}", r.prompt_ids, greedy) for r in requests],
                        loads={}, hf_config=hf_config)
        _load(rollout, new, version=1, hf_config=hf_config)
        fresh = _run(rollout, [RolloutRequest(f"new-{output.request_id}", output.prompt_ids + output.token_ids[:3],
                                              dataclasses.replace(greedy, max_new_tokens=5))
                               for output in spanning.values()], loads={}, hf_config=hf_config)
        for request in requests:
            got, before, after = (spanning[request.request_id], only_old[f"old-{request.request_id}"],
                                  fresh[f"new-{request.request_id}"])
            assert got.versions == (0,) * 3 + (1,) * 5 and got.finish_reason == "length"
            assert got.token_ids[:3] == before.token_ids[:3]  # the old policy's tokens are kept
            torch.testing.assert_close(torch.tensor(got.logprobs[:3]), torch.tensor(before.logprobs[:3]))
            assert got.token_ids[3:] == after.token_ids  # the new policy's, over the kept prefix
            torch.testing.assert_close(torch.tensor(got.logprobs[3:]), torch.tensor(after.logprobs),
                                       rtol=1e-4, atol=1e-4)
            # the first token after the load, from the same context as the old run's: another policy sampled it
            assert got.token_ids[3] != before.token_ids[3] or abs(got.logprobs[3] - before.logprobs[3]) > 1e-3
        # sampled: a load of the same weights mid-request changes no token, only the versions (each request's
        # random generator goes on through the recomputation; both runs' requests get the same vLLM seeds)
        sampled = [RolloutRequest(f"s{index}", tuple(row), dataclasses.replace(greedy, greedy=False, seed=5))
                   for index, row in enumerate(rows)]
        runs = []
        for loads in ({}, {2: (old, 1)}):
            _load(rollout, old, version=0, hf_config=hf_config)
            rollout._submissions = itertools.count()
            runs.append(_run(rollout, sampled, loads=loads, hf_config=hf_config, tokens_per_step=2))
    finally:
        rollout.release()
    steady, reloaded = runs
    assert any(len(set(output.token_ids)) > 1 for output in steady.values())  # sampled, not one repeated token
    for request in sampled:
        assert reloaded[request.request_id].token_ids == steady[request.request_id].token_ids
        torch.testing.assert_close(torch.tensor(reloaded[request.request_id].logprobs),
                                   torch.tensor(steady[request.request_id].logprobs), rtol=1e-4, atol=1e-4)
        assert reloaded[request.request_id].versions == (0,) * 4 + (1,) * 4


# The tests below build a second vLLM engine in this process. vLLM's parallel groups are process-wide and the
# engine's teardown destroys them, so every test that uses the `actors` engine has to come before these.


@pytest.mark.slow
@pytest.mark.needs_smollm2
def test_greedy_tokens_from_vllm_equal_the_native_engines_on_smollm2_in_fp32():
    from transformers import AutoModelForCausalLM

    from hybridflow.engine.decoder import DecoderStage
    from hybridflow.engine.generation import GenerationEngine
    from hybridflow.engine.vllm_rollout import VllmRollout
    from hybridflow.models.smollm2 import smollm2_path

    if smollm2_path() is None:
        pytest.skip("SmolLM2-135M not converted; run `python scripts/get_smollm2.py`")
    init_local_process_group()
    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32).eval()
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    config = GenerationConfig(backend="vllm", max_new_tokens=8, greedy=True, vllm_kv_cache_gib=0.125).for_call()
    from hybridflow.models import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path())  # left padding
    texts = ["The capital of France is", "Question: what is 12 + 30? Answer:",
             "def fibonacci(n):", "Once upon a time, in a small village,"]
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    prompts_BP, mask_BP = encoded["input_ids"], encoded["attention_mask"]
    expected = GenerationEngine(DecoderStage.from_state_dict(model.config, state)).generate(prompts_BP, mask_BP, config)
    rollout = VllmRollout(model.config, dtype=torch.float32, config=config)  # a second engine: slow test only
    rollout.load_weights({name: [tensor] for name, tensor in state.items() if name != "lm_head.weight"})
    got = rollout.generate(prompts_BP, mask_BP, config)
    rollout.release()
    assert torch.equal(got["responses"], expected["responses"])
    torch.testing.assert_close(got["logprobs"], expected["logprobs"], rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_rl_training_with_backend_vllm_logs_the_rollout_transition_and_a_small_logprob_mismatch(tmp_path):
    """The driver and workers unchanged: PPO with a critic and a reference, TIS on; a second engine (slow)."""
    from hybridflow.data import write_jsonl
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import run_rl

    task = ArithmeticTaskConfig(max_digits=1)
    write_jsonl(tmp_path / "train.jsonl", prompt_rows(16, split="train", seed=0, config=task))
    config = load_rl_config(None, [
        f"data.train_path={tmp_path / 'train.jsonl'}", "actor.model.builtin=arithmetic",
        "reward.function=arithmetic", "actor.generation.max_new_tokens=4", "actor.generation.backend=vllm",
        "actor.generation.vllm_kv_cache_gib=0.0625", "actor.loss.tis_cap=2.0", "algorithm.kl_coef=0.01",
        "batch.prompts_per_step=4", "batch.samples_per_prompt=2", "batch.mini_batch_size=4",
        "trainer.total_steps=2", "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'run'}"])
    history = run_rl(config, mode="local", tensorboard=False)
    for step in history:
        assert step["rollout/vllm_bytes_loaded"] > 0 and step["rollout/vllm_kv_cache_bytes"] == 0.0625 * 2**30
        # fp32 on both sides: the rollout's sampled log-probs are the training engine's to rounding
        assert step["rollout/logprob_abs_diff_max"] < 1e-4 and step["rollout/sequence_kl"] < 1e-6
        assert 0 <= step["actor/tis_cap_fraction"] <= 1
