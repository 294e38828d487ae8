"""GPU smoke plan (issue 17): engine, generation and a four-role PPO step of a ~1B Llama on one GPU.

Runs each part in turn, printing one JSON line per measurement (and the traceback of a part that
fails, then going on with the next), so one command on a GPU machine gives every number:

    python benchmarks/gpu_smoke.py --parts env,matmul,train,generate,ppo --out results.jsonl

- ``env``: torch / transformers versions, the GPU, the backend string ``hybridflow.device`` picks.
- ``matmul``: measured bf16 matmul FLOP/s (the peak the engine's MFU is compared with).
- ``train``: the training engine on a ~1.1B Llama (TinyLlama's shape, random weights), bf16 compute,
  fp32 master weights, micro-batch token budgets 4k and 16k (``--budgets``, which takes ``auto`` too: the
  budget it resolved to is ``resolved_budget``), without and with activation checkpointing
  (``--activation-checkpointing off,on``): tokens/s, MFU, peak allocated memory.
- ``generate``: the native generation engine on the same model in bf16, batch 128, 256 new tokens
  (EOS suppressed, so every row decodes all 256): tokens/s and KV-cache bytes.
- ``ppo``: one local-mode PPO step with actor, critic, reference and reward model of ~1B on one GPU,
  with the allocator's memory during generation and during training; once per ``--ppo-variants`` entry
  (``default``; ``offload_optimizer``: the actor's AdamW state in host memory during generation;
  ``activation_checkpointing``: actor and critic recompute activations).
- ``transition``: the 3D-HybridEngine's train -> generate transition of the ~1B model over every visible GPU
  (t = GPUs -> tg = GPUs/2, nccl), one collective per parameter (``bucket_mb`` 0) against buckets of
  256 MiB: seconds and collectives per transition. Needs 2 or more GPUs (on a CPU, ``--small`` runs it on
  2 gloo processes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

# TinyLlama-1.1B's shape with the built-in task's 24-token vocabulary (the PPO part uses its tokenizer)
ONE_B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, max_position_embeddings=4096, vocab_size=32000, head_dim=64,
             tie_word_embeddings=False)
RESULTS: list[dict] = []


def emit(part: str, **values) -> None:
    record = {"part": part, **values}
    RESULTS.append(record)
    print(json.dumps(record), flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_allocated() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def peak_reserved() -> int:
    return torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def gib(num_bytes: float) -> float:
    return round(num_bytes / 2**30, 2)


def part_env(args) -> None:
    import transformers

    from hybridflow.device import default_dtype, device_type, distributed_backend

    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    emit("env", torch=torch.__version__, transformers=transformers.__version__, device=device_type(),
         gpu=props.name if props else None, gpu_memory_gib=gib(props.total_memory) if props else None,
         backend=distributed_backend(), default_dtype=str(default_dtype()), python=sys.version.split()[0])


def measured_matmul_flops(dtype=torch.bfloat16, size: int = 8192, repeats: int = 10) -> float:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync()
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def part_matmul(args) -> None:
    size = 8192 if torch.cuda.is_available() else 1024
    args.peak = measured_matmul_flops(size=size)
    emit("matmul", dtype="bfloat16", size=size, tflops=round(args.peak / 1e12, 1))


def one_b_model_config(**extra):
    from hybridflow.models import ModelConfig

    return ModelConfig(tiny={**ONE_B, **extra}, dtype="float32")


def synthetic_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt_len + response_len), generator=generator)
    mask = torch.ones_like(ids)
    return dict(input_ids=ids, attention_mask=mask, responses=ids[:, prompt_len:], response_mask=mask[:, prompt_len:])


def nll_loss(outputs, micro_batch):
    mask = micro_batch["response_mask"].float()
    loss = -(outputs["logprobs"] * mask).sum() / micro_batch["num_tokens_global"]
    return loss, {}


def part_train(args) -> None:
    from hybridflow.device import current_device
    from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
    from hybridflow.models import build_model

    peak = getattr(args, "peak", None) or measured_matmul_flops(size=8192 if torch.cuda.is_available() else 1024)
    model_config = one_b_model_config()
    for budget, checkpointing in [(b, ac) for b in args.budgets for ac in args.activation_checkpointing]:
        reset_peak()
        # bf16 autocast on a CPU is many times slower than fp32: --small checks the script, not the numbers
        config = EngineConfig(micro_batch_tokens=budget, dtype="bfloat16" if torch.cuda.is_available() else "float32",
                              optim=OptimConfig(lr=1e-5),
                              activation_checkpointing=checkpointing == "on")
        start = time.perf_counter()
        engine = TrainingEngine(config, lambda: build_model(model_config))
        build_s = time.perf_counter() - start
        params = sum(p.numel() for p in engine.model.parameters())
        matmul_params = params - ONE_B["vocab_size"] * ONE_B["hidden_size"]  # the input embedding is a lookup
        rows, prompt_len, response_len = args.train_rows, 512, 512
        batch = synthetic_batch(rows, prompt_len, response_len, ONE_B["vocab_size"])
        tokens = rows * (prompt_len + response_len)
        engine.train_step(batch, nll_loss, outputs=("logprobs",))  # warm-up
        sync()
        times = []
        for _ in range(args.train_steps):
            start = time.perf_counter()
            metrics = engine.train_step(batch, nll_loss, outputs=("logprobs",))
            sync()
            times.append(time.perf_counter() - start)
        step_s = min(times)
        emit("train", model="llama-1.1B", params=params, dtype=config.dtype, budget=budget,
             resolved_budget=engine.token_budget,
             activation_checkpointing=checkpointing,
             rows=rows, tokens_per_step=tokens,
             micro_batches=engine.last_batch_stats["micro_batches"], build_s=round(build_s, 1),
             step_s=round(step_s, 3), tokens_per_s=round(tokens / step_s), mfu=round(6 * matmul_params * tokens / step_s / peak, 3),
             peak_allocated_gib=gib(peak_allocated()),
             peak_reserved_gib=gib(peak_reserved()), loss=round(metrics["loss"], 4),
             device=str(current_device()))
        del engine


def part_generate(args) -> None:
    from hybridflow.engine.decoder import DecoderStage
    from hybridflow.engine.generation import GenerationEngine, SamplingConfig
    from hybridflow.models import build_model

    model = build_model(one_b_model_config())
    hf_config = model.config
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = {name: tensor.to(device=device, dtype=torch.bfloat16) for name, tensor in model.state_dict().items()}
    del model
    stage = DecoderStage.from_state_dict(hf_config, state)
    engine = GenerationEngine(stage)  # the default: static decode replayed as CUDA graphs on a GPU
    check = torch.randint(3, ONE_B["vocab_size"], (16, args.prompt_len))
    greedy = SamplingConfig(max_new_tokens=32, greedy=True)
    for dtype in (torch.float32, torch.bfloat16):
        weights = {name: tensor.to(dtype) for name, tensor in state.items()}
        check_stage = DecoderStage.from_state_dict(hf_config, weights)
        eager = GenerationEngine(check_stage, static_decode=True, cuda_graphs=False).generate(
            check, torch.ones_like(check), greedy)
        graphed = GenerationEngine(check_stage).generate(check, torch.ones_like(check), greedy)
        same_BT = (eager["responses"] == graphed["responses"]).int().cumprod(dim=1).bool()  # before divergence
        emit("generate_check", dtype=str(dtype), cuda_graphs=engine.cuda_graphs,
             rows_identical=int(same_BT.all(dim=1).sum()), rows=len(check),
             first_step_tokens_equal=bool(same_BT[:, 0].all()),
             max_logprob_diff_before_divergence=float((eager["logprobs"] - graphed["logprobs"])[same_BT].abs().max()))
        del weights, check_stage
    variants = [("default", engine), ("compacting", GenerationEngine(stage, static_decode=False))]
    for (variant, engine), rows in [(v, r) for r in args.gen_rows for v in variants]:
        prompts = torch.randint(3, ONE_B["vocab_size"], (rows, args.prompt_len))
        mask = torch.ones_like(prompts)
        config = SamplingConfig(max_new_tokens=args.new_tokens, eos_token_ids=(), seed=0)
        engine.generate(prompts[:8], mask[:8], SamplingConfig(max_new_tokens=8, seed=0))  # warm-up
        sync()
        reset_peak()
        start = time.perf_counter()
        out = engine.generate(prompts, mask, config)
        sync()
        seconds = time.perf_counter() - start
        new_tokens = int(out["response_mask"].sum())
        weight_bytes = sum(t.numel() * t.element_size() for t in state.values())
        emit("generate", variant=variant, static_decode=engine.static_decode, cuda_graphs=engine.cuda_graphs,
             model="llama-1.1B", dtype="bfloat16", rows=rows, prompt_len=args.prompt_len,
             new_tokens=args.new_tokens, seconds=round(seconds, 2), tokens_per_s=round(new_tokens / seconds),
             kv_cache_gib=gib(engine.last_stats.kv_cache_bytes),
             # decode reads every weight once per step: achieved weight bandwidth, the decode roofline
             weight_read_tb_per_s=round(weight_bytes * engine.last_stats.decode_steps / seconds / 1e12, 2),
             peak_allocated_gib=gib(peak_allocated()))


def part_profile(args) -> None:
    """Where a decode step of the native engine spends its time (torch.profiler, 16 steps at batch 128)."""
    from torch.profiler import ProfilerActivity, profile

    from hybridflow.engine.decoder import DecoderStage
    from hybridflow.engine.generation import GenerationEngine, SamplingConfig
    from hybridflow.models import build_model

    model = build_model(one_b_model_config())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = {name: tensor.to(device=device, dtype=torch.bfloat16) for name, tensor in model.state_dict().items()}
    engine = GenerationEngine(DecoderStage.from_state_dict(model.config, state))
    del model
    prompts = torch.randint(3, ONE_B["vocab_size"], (128, args.prompt_len))
    config = SamplingConfig(max_new_tokens=16, seed=0)
    engine.generate(prompts, torch.ones_like(prompts), config)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        engine.generate(prompts, torch.ones_like(prompts), config)
        sync()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=18), flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)


def write_model_dir(directory: Path, *, head: str = "lm") -> Path:
    """A ~1B Llama directory with the built-in task's tokenizer (random weights); ``head`` "score": with a scalar
    score head, as `hybridflow rm` saves a reward model (a causal LM is refused as one)."""
    from hybridflow.data.builtin import ASSETS_DIR
    from hybridflow.models import build_model

    src = Path(ASSETS_DIR)
    config = one_b_model_config(vocab_size=json.loads((src / "config.json").read_text())["vocab_size"],
                                max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = build_model(config, head=head)
    model.save_pretrained(directory)
    for name in os.listdir(src):
        if name.startswith("tokenizer"):
            shutil.copy(src / name, directory / name)
    return directory


PHASES = {"ActorWorker": ("generate_sequences", "compute_log_prob", "update_actor"),
          "ReferenceWorker": ("compute_ref_log_prob",), "CriticWorker": ("compute_values", "update_critic"),
          "RewardWorker": ("compute_reward",)}


def record_phase_memory(memory: dict):
    """Wrap the role methods so each call records the allocator's peak and resident bytes (local mode); returns
    the function that unwraps them."""
    import functools

    import hybridflow.workers as workers

    def wrap(method, name):
        @functools.wraps(method)
        def timed(self, *args, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            result = method(self, *args, **kwargs)
            if torch.cuda.is_available():
                entry = memory.setdefault(name, {"peak_gib": 0.0, "after_gib": 0.0})
                entry["peak_gib"] = max(entry["peak_gib"], gib(torch.cuda.max_memory_allocated()))
                entry["after_gib"] = gib(torch.cuda.memory_allocated())
            return result
        return timed

    originals = []
    for cls_name, methods in PHASES.items():
        cls = getattr(workers, cls_name)
        for name in methods:
            originals.append((cls, name, getattr(cls, name)))
            setattr(cls, name, wrap(getattr(cls, name), f"{cls_name}.{name}"))

    def restore() -> None:
        for cls, name, method in originals:
            setattr(cls, name, method)

    return restore


PPO_VARIANTS = {
    "default": [],
    "offload_optimizer": ["actor.hybrid_engine.offload_optimizer=true"],
    "activation_checkpointing": ["actor.engine.activation_checkpointing=true",
                                 "critic.engine.activation_checkpointing=true"],
}


def part_ppo(args) -> None:
    for variant in args.ppo_variants:
        if variant not in PPO_VARIANTS:
            raise ValueError(f"--ppo-variants got {variant!r}; allowed: {sorted(PPO_VARIANTS)}")
        reset_peak()
        ppo_step(args, variant, PPO_VARIANTS[variant])


def fit_in_local_mode(config, inspect=None) -> tuple[list[dict], float, int, object]:
    """Build and fit an RLTrainer in local mode: (metrics per step, seconds to build, bytes allocated after the
    build, what ``inspect(trainer)`` returned before the shutdown)."""
    from hybridflow.controller import local_mode
    from hybridflow.trainers.rl import RLTrainer

    with local_mode():
        reset_peak()
        start = time.perf_counter()
        trainer = RLTrainer(config, tensorboard=False)
        build_s = time.perf_counter() - start
        built = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        try:
            history = trainer.fit()
            inspected = inspect(trainer) if inspect is not None else None
        finally:
            trainer.shutdown()
    return history, build_s, built, inspected


def ppo_step(args, variant: str, variant_overrides: list[str]) -> None:
    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
    from hybridflow.trainers.config.rl import load_rl_config

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = write_model_dir(tmp / "model")
        reward_dir = write_model_dir(tmp / "reward", head="score")
        write_jsonl(tmp / "train.jsonl", prompt_rows(args.ppo_prompts * 2, split="train", seed=0,
                                                     config=ArithmeticTaskConfig()))
        overrides = [
            f"data.train_path={tmp / 'train.jsonl'}", f"actor.model.path={model_dir}",
            f"critic.model.path={model_dir}", f"reward.model.path={reward_dir}", "reward.function=arithmetic",
            "algorithm.advantage_estimator=gae", f"actor.generation.max_new_tokens={args.ppo_new_tokens}",
            f"batch.prompts_per_step={args.ppo_prompts}", "batch.samples_per_prompt=2",
            f"batch.mini_batch_size={args.ppo_prompts * 2}", "trainer.total_steps=2", "trainer.progress_bar=false",
            f"trainer.output_dir={tmp / 'run'}", *variant_overrides, *args.ppo_overrides]
        config = load_rl_config(None, overrides)
        memory: dict = {}
        restore = record_phase_memory(memory)
        try:
            history, build_s, built, transition = fit_in_local_mode(
                config, inspect=lambda trainer: trainer.actor.transition_stats()[0])
        finally:
            restore()
        for record in history:
            emit("ppo", variant=variant, build_s=round(build_s, 1), after_build_gib=gib(built),
                 **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()
                    if k.startswith(("time/", "memory/", "perf/", "hybrid/", "response/")) or k in ("step", "score/mean")
                    or k.endswith("token_budget")})
        emit("ppo_transition", variant=variant,
             **{k: (gib(v) if k.endswith("bytes") else round(v, 3)) for k, v in transition.items()})
        emit("ppo_phase_memory", variant=variant, **memory)
        emit("ppo_memory", variant=variant, peak_allocated_gib=gib(peak_allocated()),
             peak_reserved_gib=gib(peak_reserved()))


def _transition_times(rank: int, world_size: int, hf_overrides: dict, bucket_mbs: list[float], repeats: int) -> list:
    from hybridflow.device import current_device
    from hybridflow.engine.hybrid_engine import HybridEngine, HybridEngineConfig, cut_training_shards
    from hybridflow.models import build_model
    from hybridflow.parallel.layout import ParallelLayout

    model = build_model(one_b_model_config(**hf_overrides))
    config, state_dict = model.config, model.state_dict()
    del model
    layout = ParallelLayout.for_world(world_size, pp_size=1, tp_size=world_size)
    device = current_device(rank)
    shards = {name: shard.to(device) for name, shard in cut_training_shards(state_dict, config, layout, rank).items()}
    del state_dict
    rows = []
    for bucket_mb in bucket_mbs:
        engine = HybridEngine(config, layout, HybridEngineConfig(tp_size=max(world_size // 2, 1), bucket_mb=bucket_mb),
                              dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        seconds = []
        for _ in range(repeats + 1):  # the first builds the communicators
            torch.distributed.barrier()
            stats = engine.to_generation(shards)
            sync()
            seconds.append(stats.seconds)
            engine.to_training()
        rows.append(dict(bucket_mb=bucket_mb, collectives=stats.collectives, bytes_received=stats.bytes_received,
                         to_generation_s=sorted(seconds[1:])[len(seconds[1:]) // 2]))
        del engine
    return rows


def part_transition(args) -> None:
    from hybridflow.parallel.launch import run_distributed

    world = min(torch.cuda.device_count(), 8) if torch.cuda.is_available() else 2
    if world < 2:
        emit("transition", skipped=f"needs 2 or more GPUs, found {world}")
        return
    # the model's shape travels with the call: the children re-import this script, whose ONE_B --small changed
    per_rank = run_distributed(_transition_times, world, dict(ONE_B), [0.0, 256.0], args.transition_repeats,
                               timeout_s=1200)
    for index, row in enumerate(per_rank[0]):
        emit("transition", world=world, train_tp=world, generation_tp=max(world // 2, 1), bucket_mb=row["bucket_mb"],
             collectives=row["collectives"], received_gib=gib(row["bytes_received"]),
             to_generation_s=round(max(r[index]["to_generation_s"] for r in per_rank), 4))


SMALL_DEFAULTS = dict(budgets=[1024, 2048], train_rows=2, train_steps=1, gen_rows=[4], prompt_len=16, new_tokens=16,
                      ppo_prompts=4, ppo_new_tokens=8, transition_repeats=2)
"""--small: sizes that make every part a few seconds on a CPU."""

PARTS = {"profile": part_profile, "env": part_env, "matmul": part_matmul, "train": part_train,
         "generate": part_generate, "ppo": part_ppo, "transition": part_transition}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="env,matmul,train,generate,ppo,transition")
    parser.add_argument("--budgets", type=lambda s: [x if x == "auto" else int(x) for x in s.split(",")],
                        default=[4096, 16384], help="train part: micro_batch_tokens values (integers or auto)")
    parser.add_argument("--train-rows", type=int, default=32)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--gen-rows", type=lambda s: [int(x) for x in s.split(",")], default=[128])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--ppo-prompts", type=int, default=64)
    parser.add_argument("--ppo-new-tokens", type=int, default=64)
    parser.add_argument("--ppo-overrides", nargs="*", default=[])
    parser.add_argument("--ppo-variants", type=lambda s: s.split(","), default=["default", "offload_optimizer"],
                        help=f"one PPO step per variant, from {sorted(PPO_VARIANTS)}")
    parser.add_argument("--activation-checkpointing", type=lambda s: s.split(","), default=["off", "on"],
                        help="train part: the settings to measure at each budget (off, on)")
    parser.add_argument("--transition-repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--small", action="store_true", help="a 2-layer, 256-wide model and small batches: a quick CPU check of this script")
    args = parser.parse_args()
    if args.small:
        for key, value in SMALL_DEFAULTS.items():  # only where the command line kept the GPU-sized default
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
        ONE_B.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)
    failed = []
    for name in args.parts.split(","):
        start = time.perf_counter()
        try:
            PARTS[name](args)
        except Exception:  # noqa: BLE001 - report and go on with the next part
            failed.append(name)
            print(f"--- part {name} failed after {time.perf_counter() - start:.0f} s ---\n{traceback.format_exc()}",
                  flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in RESULTS))
    print(f"failed parts: {failed}")


if __name__ == "__main__":
    main()
