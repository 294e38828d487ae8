"""Transition time, bytes and parameter memory of the 3D-HybridEngine vs the vanilla and full-gather baselines.

Each case runs on N local processes (gloo on CPU, nccl on CUDA via run_distributed): cut the training
shards of layout (p, t, d) from the full weights, then repeat to_generation / to_training and report
per rank the bytes received, parameter bytes during generation and the transition wall time
(median over repeats, slowest rank). Also runs one greedy generation per case and checks that all
strategies produce the same tokens.

    python benchmarks/bench_hybrid_engine.py                 # tiny model at world sizes 4 and 8
    python benchmarks/bench_hybrid_engine.py --smollm2       # plus SmolLM2-135M, t=3 -> tg=1, d=2 (6 ranks)
    python benchmarks/bench_hybrid_engine.py --bucket-mb 0   # one collective per parameter (the old transition)
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from hybridflow.engine.generation import SamplingConfig
from hybridflow.engine.hybrid_engine import HybridEngine, HybridEngineConfig, cut_training_shards, storage_bytes
from hybridflow.engine.native_rollout import NativeRollout
from hybridflow.parallel.launch import run_distributed
from hybridflow.parallel.layout import ParallelLayout


def tiny_config():
    from transformers import LlamaConfig

    # the test model scaled up a little so that bytes, not latency, dominate: about 3.4 M parameters
    return LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)


def load_model(name: str):
    from transformers import AutoModelForCausalLM

    if name == "tiny":
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_config()).eval()
    from hybridflow.models.smollm2 import smollm2_path

    return AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32).eval()


def _measure(rank: int, world_size: int, model_name: str, cases, repeats: int, bucket_mb: float) -> list[dict]:
    model = load_model(model_name)
    config, state_dict = model.config, model.state_dict()
    del model
    prompts = torch.randint(3, 200, (world_size * 2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(prompts)
    results = []
    for p, t, pg, tg, strategy in cases:
        layout = ParallelLayout.for_world(world_size, pp_size=p, tp_size=t)
        shards = cut_training_shards(state_dict, config, layout, rank)
        engine = HybridEngine(config, layout, HybridEngineConfig(pp_size=pg, tp_size=tg, strategy=strategy,
                                                                 bucket_mb=bucket_mb))
        going, back = [], []
        for _ in range(repeats):
            torch.distributed.barrier()
            going.append(engine.to_generation(shards))
            torch.distributed.barrier()
            back.append(engine.to_training())
        engine.to_generation(shards)
        share = len(prompts) // engine.num_replicas
        rows = slice(engine.replica * share, (engine.replica + 1) * share)
        greedy = SamplingConfig(max_new_tokens=4, greedy=True)
        rollout = NativeRollout(config, dtype=engine.dtype, config=greedy)
        rollout.load(engine.shard, version=0)
        out = rollout.generate(prompts[rows], mask[rows], greedy)
        rollout.release()
        engine.to_training()
        results.append(dict(
            case=(p, t, pg, tg, strategy), replica=engine.replica, responses=out["responses"].tolist(),
            bytes_received=going[-1].bytes_received, bytes_sent=going[-1].bytes_sent,
            training_bytes=storage_bytes(shards.values()), generation_bytes=going[-1].param_bytes,
            peak_bytes=going[-1].peak_param_bytes, collectives=going[-1].collectives,
            to_generation_s=statistics.median(s.seconds for s in going),
            to_training_s=statistics.median(s.seconds for s in back)))
        del shards, engine
    return results


def model_bytes(model_name: str) -> int:
    model = load_model(model_name)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run(model_name: str, world_size: int, cases, repeats: int, bucket_mb: float) -> None:
    per_rank = run_distributed(_measure, world_size, model_name, cases, repeats, bucket_mb, timeout_s=1800)
    total = model_bytes(model_name)
    print(f"\n{model_name}: M = {total / 2**20:.2f} MiB (fp32), world size {world_size}, repeats {repeats}, "
          f"bucket_mb {bucket_mb:g}")
    print(f"{'p-t-d -> pg-tg':>16} {'strategy':>11} {'recv MiB/rank':>14} {'recv / M':>9} "
          f"{'train MiB':>10} {'gen MiB':>8} {'peak MiB':>9} {'colls':>6} {'to_gen ms':>10} {'to_train ms':>12}")
    reference = None
    for index, case in enumerate(cases):
        rows = [r[index] for r in per_rank]
        p, t, pg, tg, strategy = case
        d = world_size // (p * t)
        mib = lambda key: max(r[key] for r in rows) / 2**20  # noqa: E731 - slowest/largest rank
        recv = max(r["bytes_received"] for r in rows)
        print(f"{f'{p}-{t}-{d} -> {pg}-{tg}':>16} {strategy:>11} {recv / 2**20:>14.3f} {recv / total:>9.4f} "
              f"{mib('training_bytes'):>10.2f} {mib('generation_bytes'):>8.2f} {mib('peak_bytes'):>9.2f} "
              f"{max(r['collectives'] for r in rows):>6} "
              f"{1e3 * max(r['to_generation_s'] for r in rows):>10.2f} "
              f"{1e3 * max(r['to_training_s'] for r in rows):>12.3f}")
        tokens = {}
        for r in rows:
            tokens.setdefault(r["replica"], r["responses"])
        ordered = [row for replica in sorted(tokens) for row in tokens[replica]]
        if reference is None:
            reference = ordered
        elif ordered != reference:
            print(f"  !! greedy tokens of {case} differ from the first case's", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", action="store_true", help="also run SmolLM2-135M on 6 ranks")
    parser.add_argument("--skip-tiny", action="store_true", help="only the SmolLM2 case")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=256.0,
                        help="actor.hybrid_engine.bucket_mb of every case (0 = one collective per parameter)")
    args = parser.parse_args()
    if not args.skip_tiny:
        run_tiny(args.repeats, args.bucket_mb)
    if args.smollm2:
        from hybridflow.models.smollm2 import smollm2_path

        if smollm2_path() is None:
            print("SmolLM2-135M not converted (scripts/get_smollm2.py); skipped")
        else:
            run("smollm2", 6, [(1, 3, 1, 1, s) for s in ("hybrid", "vanilla", "full_gather")], args.repeats,
                args.bucket_mb)


def run_tiny(repeats: int, bucket_mb: float) -> None:
    run("tiny", 4, [(1, 4, 1, 1, s) for s in ("hybrid", "vanilla", "full_gather")]
        + [(1, 4, 1, 2, "hybrid"), (1, 4, 1, 2, "vanilla"), (2, 2, 1, 1, "hybrid"), (2, 2, 2, 1, "hybrid"),
           (2, 2, 1, 1, "vanilla")], repeats, bucket_mb)
    run("tiny", 8, [(1, 4, 1, 2, s) for s in ("hybrid", "vanilla")] + [(1, 4, 1, 1, "full_gather"),
        (2, 4, 1, 2, "hybrid"), (2, 4, 2, 2, "hybrid"), (2, 4, 1, 2, "vanilla")], repeats, bucket_mb)


if __name__ == "__main__":
    main()
