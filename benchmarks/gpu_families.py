"""The 2026 families on one GPU (issue 35): Qwen3, Qwen3-MoE and Gemma 3 through the native decoder and the training
engine, and GRPO steps with LoRA and with routing replay, each on a random model of a real checkpoint's shape.

One JSON line per measurement (a part that fails prints its traceback and the next part runs), like
benchmarks/gpu_smoke.py, whose helpers it shares:

    python benchmarks/gpu_families.py --parts check,generate,train,grpo --out families.jsonl

- ``check``: per family, fp32, 8 prompts x 32 greedy tokens: the native decoder replayed as CUDA graphs against
  its eager static decode and against transformers' ``generate`` (rows identical; largest log-prob difference
  before the first diverging token).
- ``generate``: per family, bf16, 128 prompts of 128 tokens, 256 new tokens with EOS off: the static decode as CUDA
  graphs (the GPU default) against the compacting eager decode; for Qwen3-MoE also with routing recorded
  (``record_routing``, which decodes without graphs).
- ``train``: per family, bf16 autocast over fp32 masters and AdamW, 16 rows of 1024 tokens in micro-batches of
  16,384 tokens: tokens/s, MFU (6 x active matmul parameters x tokens against the measured bf16 peak), peak memory.
- ``grpo``: local-mode GRPO steps (actor and reference, the built-in arithmetic reward) on the Llama of ~1.1B
  with full fine-tuning and with ``actor.lora`` (rank 16), and on the Qwen3-MoE shape with
  ``actor.routing_replay``: seconds per phase and allocator memory.

``--small`` runs every part on a CPU in seconds (tiny shapes) to check the script.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_smoke  # noqa: E402  (the shared helpers: emit, sync, memory, the matmul peak, the ~1B Llama shape)
from gpu_smoke import emit, gib, peak_allocated, reset_peak, sync  # noqa: E402

SHAPES = {
    # Qwen3-0.6B (vocabulary cut to 32,000: the head's size is not what is measured)
    "qwen3": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=32000, tie_word_embeddings=True),
    # Qwen3-30B-A3B's routing (8 experts per token, q/k norms, head_dim 128) over 12 layers of 64 experts of width 512
    # (1.3 B parameters, 0.25 B active per token)
    "qwen3_moe": dict(hidden_size=1024, moe_intermediate_size=512, num_hidden_layers=12, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
                      vocab_size=32000, tie_word_embeddings=False),
    # Gemma-3-1B: five sliding-window layers (window 512) per global one
    "gemma3_text": dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                        vocab_size=32000, tie_word_embeddings=True,
                        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                     for i in range(26)]),
}
SMALL_SHAPES = {
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=256),
    "qwen3_moe": dict(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, vocab_size=256),
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                        vocab_size=256, layer_types=["sliding_attention", "full_attention"]),
}


def model_config(family: str, shapes: dict, **extra):
    from hybridflow.models import ModelConfig

    return ModelConfig(tiny={"max_position_embeddings": 4096, **shapes[family], **extra}, family=family,
                       dtype="float32")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def build_on_device(family: str, small: bool):
    """The random model of ``family`` on the device, built once for every part."""
    from hybridflow.models import build_model

    return build_model(model_config(family, SMALL_SHAPES if small else SHAPES)).to(device())


def active_matmul_params(model) -> int:
    """Parameters a token's forward multiplies by: all but the input embedding, with only the chosen experts."""
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    total -= config.vocab_size * config.hidden_size * (0 if config.tie_word_embeddings else 1)
    experts = getattr(config, "num_experts", 0)
    if experts:
        per_expert = 3 * config.hidden_size * config.moe_intermediate_size
        moe_layers = sum(1 for i in range(config.num_hidden_layers) if i not in (config.mlp_only_layers or []))
        total -= moe_layers * per_expert * (experts - config.num_experts_per_tok)
    return total


def stage_of(model, dtype):
    from hybridflow.engine.decoder import DecoderStage

    state = {name: tensor.detach().to(dtype) for name, tensor in model.state_dict().items()}
    return DecoderStage.from_state_dict(model.config, state)


def first_divergence(a_BT: torch.Tensor, b_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] True up to (not including) each row's first differing token."""
    return (a_BT == b_BT).int().cumprod(dim=1).bool()


def part_check(args) -> None:
    from hybridflow.engine.generation import GenerationEngine, SamplingConfig

    for family in args.families:
        model = build_on_device(family, args.small)
        stage = stage_of(model, torch.float32)
        prompts = torch.randint(3, model.config.vocab_size, (8, 32))
        mask = torch.ones_like(prompts)
        greedy = SamplingConfig(max_new_tokens=32, greedy=True)
        graphed = {k: v.cpu() for k, v in GenerationEngine(stage).generate(prompts, mask, greedy).items()}
        eager = {k: v.cpu() for k, v in GenerationEngine(stage, static_decode=True, cuda_graphs=False).generate(
            prompts, mask, greedy).items()}
        with torch.no_grad():
            hf = model.generate(prompts.to(device()), attention_mask=mask.to(device()), do_sample=False,
                                max_new_tokens=32, min_new_tokens=32, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=0)
        hf_tokens = hf.sequences[:, prompts.shape[1]:].cpu()
        hf_logprobs = torch.stack([torch.log_softmax(s.float(), -1) for s in hf.logits], 1).cpu()
        hf_logprobs = hf_logprobs.gather(-1, hf_tokens[..., None])[..., 0]
        same_eager = first_divergence(graphed["responses"], eager["responses"])
        same_hf = first_divergence(graphed["responses"], hf_tokens)
        emit("check", family=family, dtype="float32", cuda_graphs=GenerationEngine(stage).cuda_graphs,
             rows=len(prompts), graphed_eq_eager_rows=int(same_eager.all(1).sum()),
             graphed_eq_hf_rows=int(same_hf.all(1).sum()),
             max_logprob_diff_eager=float((graphed["logprobs"] - eager["logprobs"])[same_eager].abs().max()),
             max_logprob_diff_hf=float((graphed["logprobs"] - hf_logprobs)[same_hf].abs().max()))
        del stage
        reset_peak()


def timed_generate(engine, prompts, config):
    from hybridflow.engine.generation import SamplingConfig

    mask = torch.ones_like(prompts)
    engine.generate(prompts[:8], mask[:8], SamplingConfig(max_new_tokens=8, seed=0,
                                                          record_routing=config.record_routing))  # warm-up
    sync()
    reset_peak()
    start = time.perf_counter()
    out = engine.generate(prompts, mask, config)
    sync()
    return out, time.perf_counter() - start


def part_generate(args) -> None:
    from hybridflow.engine.generation import GenerationEngine, SamplingConfig

    for family in args.families:
        stage = stage_of(build_on_device(family, args.small), torch.bfloat16)
        prompts = torch.randint(3, args.shapes[family]["vocab_size"], (args.rows, args.prompt_len))
        variants = [("graphed", GenerationEngine(stage), False)]
        if family in args.compacting:
            variants.append(("compacting", GenerationEngine(stage, static_decode=False), False))
        if "num_experts" in args.shapes[family]:
            variants.append(("graphed_engine_recording_routing", GenerationEngine(stage), True))
        for variant, engine, record in variants:
            config = SamplingConfig(max_new_tokens=args.new_tokens, eos_token_ids=(), seed=0, record_routing=record)
            out, seconds = timed_generate(engine, prompts, config)
            new_tokens = int(out["response_mask"].sum())
            emit("generate", family=family, variant=variant, static_decode=engine.static_decode,
                 cuda_graphs=engine.cuda_graphs and not record, record_routing=record, rows=args.rows,
                 prompt_len=args.prompt_len, new_tokens=args.new_tokens, seconds=round(seconds, 2),
                 tokens_per_s=round(new_tokens / seconds), kv_cache_gib=gib(engine.last_stats.kv_cache_bytes),
                 routed_experts_shape=list(out["routed_experts"].shape) if record else None,
                 peak_allocated_gib=gib(peak_allocated()))
        del stage, variants
        reset_peak()


def part_train(args) -> None:
    from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine

    peak = getattr(args, "peak", None) or gpu_smoke.measured_matmul_flops(size=8192 if device() == "cuda" else 512)
    for family in args.families:
        reset_peak()
        config = EngineConfig(micro_batch_tokens=args.budget, optim=OptimConfig(lr=1e-5),
                              dtype="bfloat16" if device() == "cuda" else "float32")
        engine = TrainingEngine(config, lambda: copy.deepcopy(build_on_device(family, args.small)))
        active = active_matmul_params(engine.model)
        rows, half = args.train_rows, args.seq_len // 2
        batch = gpu_smoke.synthetic_batch(rows, half, half, args.shapes[family]["vocab_size"])
        tokens = rows * args.seq_len
        engine.train_step(batch, gpu_smoke.nll_loss, outputs=("logprobs",))  # warm-up
        sync()
        times = []
        for _ in range(args.train_steps):
            start = time.perf_counter()
            metrics = engine.train_step(batch, gpu_smoke.nll_loss, outputs=("logprobs",))
            sync()
            times.append(time.perf_counter() - start)
        step_s = min(times)
        emit("train", family=family, params=sum(p.numel() for p in engine.model.parameters()),
             active_matmul_params=active, dtype=config.dtype, budget=args.budget,
             micro_batches=engine.last_batch_stats["micro_batches"], tokens_per_step=tokens, step_s=round(step_s, 3),
             tokens_per_s=round(tokens / step_s), mfu=round(6 * active * tokens / step_s / peak, 3),
             peak_allocated_gib=gib(peak_allocated()), loss=round(metrics["loss"], 4))
        del engine


def write_family_dir(directory: Path, family: str, shape: dict) -> Path:
    """A model directory of ``family`` with the built-in task's tokenizer (random weights)."""
    from hybridflow.data.builtin import ASSETS_DIR
    from hybridflow.models import build_model

    src = Path(ASSETS_DIR)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    model = build_model(model_config(family, {family: shape}, vocab_size=vocab, max_position_embeddings=512,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0))
    model.save_pretrained(directory)
    for name in os.listdir(src):
        if name.startswith("tokenizer"):
            shutil.copy(src / name, directory / name)
    return directory


def grpo_variants(args) -> dict:
    llama = {**gpu_smoke.ONE_B}
    return {"llama_full": ("llama", llama, []),
            "llama_lora": ("llama", llama, ["actor.lora.rank=16", "actor.lora.alpha=32"]),
            "qwen3_moe": ("qwen3_moe", args.shapes["qwen3_moe"], []),  # its rollout replays decode steps as graphs
            "qwen3_moe_routing_replay": ("qwen3_moe", args.shapes["qwen3_moe"], ["actor.routing_replay=true"])}


def part_grpo(args) -> None:
    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
    from hybridflow.trainers.config.rl import load_rl_config

    variants = grpo_variants(args)
    for variant in args.grpo_variants or list(variants):
        family, shape, overrides = variants[variant]
        reset_peak()
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            model_dir = write_family_dir(tmp / "model", family, shape)
            write_jsonl(tmp / "train.jsonl", prompt_rows(args.grpo_prompts * 3, split="train", seed=0,
                                                         config=ArithmeticTaskConfig()))
            config = load_rl_config(None, [
                f"data.train_path={tmp / 'train.jsonl'}", f"actor.model.path={model_dir}",
                "reward.function=arithmetic", "algorithm.advantage_estimator=grpo",
                f"actor.generation.max_new_tokens={args.grpo_new_tokens}",
                f"batch.prompts_per_step={args.grpo_prompts}", "batch.samples_per_prompt=4",
                f"batch.mini_batch_size={args.grpo_prompts * 4}", f"trainer.total_steps={args.grpo_steps}",
                "trainer.progress_bar=false", f"trainer.output_dir={tmp / 'run'}", *overrides])
            history, build_s, built, _ = gpu_smoke.fit_in_local_mode(config)
        for record in history:
            emit("grpo", variant=variant, family=family, build_s=round(build_s, 1), after_build_gib=gib(built),
                 **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()
                    if k.startswith(("time/", "memory/", "response/", "rollout/")) or k == "step"
                    or "routing" in k or k.startswith("actor/lora")})
        emit("grpo_memory", variant=variant, peak_allocated_gib=gib(peak_allocated()))


PARTS = {"env": gpu_smoke.part_env, "matmul": gpu_smoke.part_matmul, "check": part_check,
         "generate": part_generate, "train": part_train, "grpo": part_grpo}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="env,matmul,check,generate,train,grpo")
    parser.add_argument("--families", default=",".join(SHAPES), type=lambda s: s.split(","))
    parser.add_argument("--compacting", default=",".join(SHAPES), type=lambda s: s.split(","),
                        help="generate part: families also measured with the compacting eager decode")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--train-rows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--train-steps", type=int, default=3)
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--grpo-prompts", type=int, default=32)
    parser.add_argument("--grpo-new-tokens", type=int, default=64)
    parser.add_argument("--grpo-steps", type=int, default=2)
    parser.add_argument("--grpo-variants", type=lambda s: s.split(","), default=None,
                        help="grpo part: llama_full, llama_lora, qwen3_moe, qwen3_moe_routing_replay (default: all)")
    parser.add_argument("--small", action="store_true", help="tiny shapes and sizes: check the script on a CPU")
    parser.add_argument("--out", default=None, help="also write the JSON lines to this file")
    args = parser.parse_args()
    args.shapes = SMALL_SHAPES if args.small else SHAPES
    if args.small:
        gpu_smoke.ONE_B.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=256)
        for key, value in dict(rows=4, prompt_len=16, new_tokens=16, train_rows=2, seq_len=64, train_steps=1,
                               budget=128, grpo_prompts=4, grpo_new_tokens=8, grpo_steps=1).items():
            setattr(args, key, value)
    for part in args.parts.split(","):
        if part not in PARTS:
            raise SystemExit(f"--parts got {part!r}; allowed: {sorted(PARTS)}")
        try:
            PARTS[part](args)
        except Exception:  # one part's failure must not hide the others' numbers
            traceback.print_exc()
            emit(part, failed=traceback.format_exc().strip().splitlines()[-1])
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in gpu_smoke.RESULTS))


if __name__ == "__main__":
    main()
