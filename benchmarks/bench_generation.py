"""Generation throughput (tokens/s) of hybridflow's engine vs transformers' generate, same model, batch and lengths.

Greedy decoding without EOS, so both produce exactly batch x new-tokens tokens; the script also
checks that both produce the same tokens. Single process, on the device hybridflow picks, in fp32 or with
``--dtype bfloat16`` both engines in bf16 (``--dtype auto``: what ``engine.dtype: auto`` picks for the model).

    python benchmarks/bench_generation.py                  # tiny model
    python benchmarks/bench_generation.py --smollm2        # SmolLM2-135M-Instruct too (if converted)
    python benchmarks/bench_generation.py --smollm2 --batch 32 --new-tokens 64   # the issue's decode check
    python benchmarks/bench_generation.py --projections    # F.linear vs the decoder's feature-major products
    python benchmarks/bench_generation.py --smollm2 --batch 32 --feature-major-ab   # whole decode, with vs without
    python benchmarks/bench_generation.py --smollm2 --batch 32 --new-tokens 64 --dtype bfloat16
    python benchmarks/bench_generation.py --model narrow --batch 128 --prompt-len 7 --new-tokens 32 --decode-attention-ab
    python benchmarks/bench_generation.py --model narrow --batch 128 --prompt-len 7 --new-tokens 32 --decode-bias-ab
    python benchmarks/bench_generation.py --model narrow --batch 128 --prompt-len 7 --new-tokens 32 --inference-mode-ab

Each line also gives hybridflow's matmul FLOP/s as a fraction of this machine's fp32 matmul peak
(1024^3, measured in the same run at the same thread count), and in bf16 of the bf16 peak too.
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridflow.device import current_device
from hybridflow.engine.config import EngineConfig
from hybridflow.engine.decoder import DecoderStage, head_logits, project
from hybridflow.engine.generation import GenerationEngine, SamplingConfig


MODELS = {
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4),
    # the shape of benchmarks/vs_trl's tiny model (a character vocabulary)
    "narrow": dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4),
}
"""Random-init Llama models by name (seeded); ``smollm2`` loads the converted checkpoint."""


def load(name: str, device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if name in MODELS:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(LlamaConfig(**MODELS[name])).to(device).eval()
    from hybridflow.models.smollm2 import smollm2_path

    return AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32).to(device).eval()


def timed(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, result


def workload(name: str, *, batch: int, prompt_len: int, new_tokens: int, dtype: str = "float32"):
    """(HF model, hybridflow engine on its weights, prompts, mask, greedy config) on the device hybridflow picks,
    both in ``dtype`` ('auto': ``engine.dtype: auto`` for this model)."""
    device = current_device()
    model = load(name, device)
    model = model.to(EngineConfig(dtype=dtype).resolve_dtype(model.config.hidden_size))
    engine = GenerationEngine(DecoderStage.from_state_dict(model.config, model.state_dict()))
    vocab = model.config.vocab_size
    prompts = torch.randint(3, min(1000, vocab), (batch, prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
    return model, engine, prompts, torch.ones_like(prompts), SamplingConfig(max_new_tokens=new_tokens, greedy=True)


def bench(name: str, *, batch: int, prompt_len: int, new_tokens: int, repeats: int, dtype: str) -> None:
    model, engine, prompts, mask, config = workload(name, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                                                    dtype=dtype)

    def ours():
        return engine.generate(prompts, mask, config)["responses"]

    def theirs():
        with torch.no_grad():
            return model.generate(prompts, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[:, prompt_len:]

    ours(), theirs()  # warm-up
    ours_s, ours_tokens = timed(ours, repeats)
    theirs_s, theirs_tokens = timed(theirs, repeats)
    same = torch.equal(ours_tokens, theirs_tokens)
    agree = (ours_tokens == theirs_tokens).long().cumprod(1).sum(1).float().mean()  # tokens before rows diverge
    generated = batch * new_tokens
    # matmul FLOPs: every prompt token once (prefill) and every fed-back token once (decode), 2 per weight
    # of the linear layers and the output head (the embedding lookup is not a matmul; attention not counted)
    head = model.get_output_embeddings().weight.numel()
    linear = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n
                 and "lm_head" not in n) + head
    flops = 2 * linear * batch * (prompt_len + new_tokens - 1)
    compute = next(model.parameters()).dtype
    peak = matmul_peak(prompts.device)
    of_peak = f"{flops / ours_s / peak:.0%} of the fp32 matmul peak {peak / 1e9:.1f}"
    if compute != torch.float32:
        half_peak = matmul_peak(prompts.device, dtype=compute)
        of_peak += f", {flops / ours_s / half_peak:.0%} of the {str(compute)[6:]} peak {half_peak / 1e9:.1f}"
    print(f"{name:>8} {str(prompts.device):>6} {str(compute)[6:]} threads={torch.get_num_threads()} batch={batch} "
          f"prompt={prompt_len} new={new_tokens}: hybridflow {generated / ours_s:8.1f} tok/s ({ours_s:.3f} s, "
          f"{flops / ours_s / 1e9:.1f} GFLOP/s = {of_peak}), transformers generate {generated / theirs_s:8.1f} "
          f"tok/s ({theirs_s:.3f} s, {flops / theirs_s / peak:.0%} of fp32), ratio {theirs_s / ours_s:.2f}x, "
          f"same tokens: {same}" + ("" if same else f" (rows agree for {agree:.1f} of {new_tokens} tokens on average)"))


def matmul_peak(device, size: int = 1024, seconds: float = 1.0, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a size^3 matmul in ``dtype`` on ``device`` at the current thread count (best of a short loop)."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    best, started = float("inf"), time.perf_counter()
    while time.perf_counter() - started < seconds:
        best = min(best, timed(lambda: a @ b, 1)[0])
    return 2 * size ** 3 / best


def bench_projections(repeats: int) -> None:
    """GFLOP/s of ``F.linear`` against the decoder's ``project`` / ``head_logits`` on SmolLM2-135M's projection
    shapes (hidden 576, kv 192, intermediate 1536, vocabulary 49,152), fp32, by number of rows."""
    shapes = {"q/o 576->576": (576, 576), "k/v 576->192": (576, 192), "gate/up 576->1536": (576, 1536),
              "down 1536->576": (1536, 576), "head 576->49152": (576, 49152)}
    device = current_device()
    print(f"fp32, {torch.get_num_threads()} threads, {device}; GFLOP/s F.linear / decoder (ratio)")
    for rows in (32, 128, 256, 512, 1024, 4096):
        cells = []
        for label, (k, n) in shapes.items():
            x = torch.randn(rows, k, device=device)
            w = torch.randn(n, k, device=device)
            ours = head_logits if label.startswith("head") else project
            loops = max(1, int(2e9 // (2 * rows * k * n)))  # about 2 GFLOP per timing
            linear_s = timed(lambda: [torch.nn.functional.linear(x, w) for _ in range(loops)], repeats)[0] / loops
            ours_s = timed(lambda: [ours(x, w) for _ in range(loops)], repeats)[0] / loops
            flops = 2 * rows * k * n
            cells.append(f"{label} {flops / linear_s / 1e9:.0f} / {flops / ours_s / 1e9:.0f} "
                         f"({linear_s / ours_s:.2f}x)")
        print(f"rows {rows:>5}: " + "; ".join(cells))


def alternate(name: str, variants: dict, *, repeats: int, batch: int, prompt_len: int, new_tokens: int,
              model) -> None:
    """Time each variant (label -> zero-argument function returning the responses) in turn, ``repeats`` rounds
    after one warm-up round, so all see the same machine load; print the best of each and their ratio."""
    seconds, tokens = {label: [] for label in variants}, {}
    for _ in range(repeats + 1):
        for label, fn in variants.items():
            elapsed, tokens[label] = timed(fn, 1)
            seconds[label].append(elapsed)
    (off, off_s), (on, on_s) = ((label, min(times[1:])) for label, times in seconds.items())
    compute = str(next(model.parameters()).dtype)[6:]
    print(f"{name} {compute} threads={torch.get_num_threads()} batch={batch} prompt={prompt_len} new={new_tokens}: "
          f"{off} {off_s:.4f} s, {on} {on_s:.4f} s ({off_s / on_s:.2f}x), "
          f"same tokens: {torch.equal(tokens[off], tokens[on])}")


def decoder_switch_ab(name: str, switch: str, off_value, labels: tuple[str, str], *, batch: int, prompt_len: int,
                      new_tokens: int, repeats: int, dtype: str) -> None:
    """The same greedy generate with the decoder's module constant ``switch`` at ``off_value`` and at its
    default, alternating (``alternate``)."""
    from hybridflow.engine import decoder

    model, engine, prompts, mask, config = workload(name, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                                                    dtype=dtype)
    default = getattr(decoder, switch)

    def with_switch(value):
        def run():
            setattr(decoder, switch, value)
            return engine.generate(prompts, mask, config)["responses"]
        return run

    try:
        alternate(name, {labels[0]: with_switch(off_value), labels[1]: with_switch(default)}, repeats=repeats,
                  batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, model=model)
    finally:
        setattr(decoder, switch, default)


def inference_mode_ab(name: str, *, batch: int, prompt_len: int, new_tokens: int, repeats: int, dtype: str) -> None:
    """The same greedy generate under ``torch.no_grad`` (its decode only) and as ``generate`` runs it (under
    ``torch.inference_mode``), alternating (``alternate``)."""
    model, engine, prompts, mask, config = workload(name, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                                                    dtype=dtype)

    def no_grad():
        with torch.no_grad():
            return engine._generate(prompts, mask, config)["responses"]

    alternate(name, {"no_grad": no_grad,
                     "inference_mode": lambda: engine.generate(prompts, mask, config)["responses"]},
              repeats=repeats, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, model=model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", action="store_true")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny",
                        help="the random-init model (tiny: 256 wide, 4 layers; narrow: vs_trl's tiny shape, 64 wide)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--projections", action="store_true",
                        help="only time F.linear against the decoder's projections on SmolLM2's shapes")
    parser.add_argument("--feature-major-ab", action="store_true",
                        help="time the decode with the feature-major projections off and on, alternating")
    parser.add_argument("--decode-attention-ab", action="store_true",
                        help="time the decode with SDPA and with the batched-matmul decode attention, alternating")
    parser.add_argument("--decode-bias-ab", action="store_true",
                        help="time the fp32 decode with the boolean key mask per layer and with one additive bias "
                             "per step, alternating")
    parser.add_argument("--inference-mode-ab", action="store_true",
                        help="time the decode under torch.no_grad and under torch.inference_mode, alternating")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
                        help="both engines' weights and compute ('auto': engine.dtype auto for the model)")
    args = parser.parse_args()
    shape = dict(batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats)
    if args.feature_major_ab:
        decoder_switch_ab("smollm2" if args.smollm2 else args.model, "FEATURE_MAJOR_MAX_ROWS", 0,
                          ("F.linear everywhere", "feature-major decode"), dtype="float32", **shape)
        return
    if args.inference_mode_ab:
        inference_mode_ab("smollm2" if args.smollm2 else args.model, dtype=args.dtype, **shape)
        return
    if args.decode_attention_ab:
        decoder_switch_ab("smollm2" if args.smollm2 else args.model, "CPU_DECODE_MATMUL_ATTENTION", False,
                          ("SDPA decode attention", "batched-matmul decode attention"), dtype=args.dtype, **shape)
        return
    if args.decode_bias_ab:
        decoder_switch_ab("smollm2" if args.smollm2 else args.model, "CPU_DECODE_BIAS", False,
                          ("boolean mask per layer", "additive bias per step"), dtype="float32", **shape)
        return
    if args.projections:
        bench_projections(args.repeats)
        return
    names = [args.model] + (["smollm2"] if args.smollm2 else [])
    for name in names:
        bench(name, dtype=args.dtype, **shape)


if __name__ == "__main__":
    main()
