"""Rollout tokens/s of the vLLM backend vs hybridflow's native engine vs transformers' ``generate``, and the
vLLM weight update (seconds, bytes) the actor pays before every rollout.

Greedy decoding without EOS (every row generates exactly ``--new-tokens``), random prompts of
``--prompt-len`` tokens. One vLLM engine per dtype, built once (its start-up time is printed apart).
Needs vLLM (``pip install 'hybridflow[vllm]'``); run it under the ``__main__`` guard as here.

    python benchmarks/bench_vllm.py                          # SmolLM2-135M if converted, else the built-in model
    python benchmarks/bench_vllm.py --batches 32 128 --dtypes float32 bfloat16 --new-tokens 256
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def load_model(name: str):
    from transformers import AutoModelForCausalLM

    if name == "smollm2":
        from hybridflow.models.smollm2 import smollm2_path

        return AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32).eval()
    from hybridflow.data.builtin import builtin_model_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(builtin_model_config()).eval()


def agreeing_prefix(a_BT: torch.Tensor, b_BT: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading tokens two decodes share."""
    return (a_BT == b_BT).long().cumprod(dim=1).sum(dim=1)


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def bench_dtype(model, dtype: torch.dtype, *, batches: list[int], prompt_len: int, new_tokens: int,
                repeats: int, engines: list[str]) -> None:
    from hybridflow.engine.decoder import DecoderStage
    from hybridflow.engine.generation import GenerationEngine, SamplingConfig
    from hybridflow.engine.vllm_rollout import VllmRollout

    config = SamplingConfig(backend="vllm", max_new_tokens=new_tokens, greedy=True, use_model_defaults=False,
                              vllm_kv_cache_gib=2.0)
    state = {name: tensor.detach().to(dtype) for name, tensor in model.state_dict().items()}
    weights = {name: [tensor] for name, tensor in state.items() if name.startswith(("model.", "lm_head."))}
    dtype_name = str(dtype).removeprefix("torch.")
    rollout = None
    if "vllm" in engines:
        start = time.perf_counter()
        rollout = VllmRollout(model.config, dtype=dtype, config=config)
        print(f"vllm engine start ({dtype_name}): {time.perf_counter() - start:.1f} s", flush=True)
        loads = [rollout.load_weights(weights) for _ in range(3)]
        load = min(loads, key=lambda s: s.seconds)
        print(f"vllm weight update ({dtype_name}): {load.seconds:.3f} s for {load.bytes_loaded / 2**20:.1f} MiB "
              f"(vLLM params {load.param_bytes / 2**20:.1f} MiB, KV cache {load.kv_cache_bytes / 2**20:.0f} MiB)",
              flush=True)
    native = GenerationEngine(DecoderStage.from_state_dict(model.config, state))
    hf_model = model.to(dtype)
    vocab = model.config.vocab_size
    for batch in batches:
        prompts_BP = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch))
        mask_BP = torch.ones_like(prompts_BP)
        tokens = batch * new_tokens
        results = {}
        if "vllm" in engines:
            results["vllm"] = best_of(lambda: rollout.generate(prompts_BP, mask_BP, config)["responses"], repeats)
        if "native" in engines:
            results["native"] = best_of(lambda: native.generate(prompts_BP, mask_BP, config)["responses"], repeats)
        if "transformers" in engines:
            def hf_generate():
                with torch.no_grad():
                    out = hf_model.generate(prompts_BP, attention_mask=mask_BP, max_new_tokens=new_tokens,
                                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
                return out[:, prompt_len:]
            results["transformers"] = best_of(hf_generate, repeats)
        line = ", ".join(f"{name} {tokens / seconds:.0f} tok/s" for name, (seconds, _) in results.items())
        # greedy decodes agree until a near-tie flips an argmax (random prompts have many); then they diverge
        same = {name: f"{float(agreeing_prefix(out, results['native'][1]).float().mean()):.1f}"
                for name, (_, out) in results.items() if "native" in results and name != "native"}
        print(f"{dtype_name} batch {batch} x ({prompt_len} + {new_tokens}): {line}; mean tokens equal to native's "
              f"before the first difference: {same}", flush=True)
    if rollout is not None:
        rollout.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["auto", "smollm2", "builtin"], default="auto")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--engines", nargs="+", default=["vllm", "native", "transformers"])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    name = args.model
    if name == "auto":
        from hybridflow.models.smollm2 import smollm2_path

        name = "smollm2" if smollm2_path() else "builtin"
    print(f"model {name}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}", flush=True)
    model = load_model(name)
    for dtype_name in args.dtypes:
        bench_dtype(model, getattr(torch, dtype_name), batches=args.batches, prompt_len=args.prompt_len,
                    new_tokens=args.new_tokens, repeats=args.repeats, engines=args.engines)


if __name__ == "__main__":
    main()
