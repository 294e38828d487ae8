"""Streaming asynchronous RL (``async.mode: streaming``, docs/async.md "Modes") with the vLLM rollout backend: the
replica's vLLM engine takes every weight sync with requests in flight and continues them with the new weights.

The run is the one of ``tests/test_async_streaming.py`` (GRPO on the arithmetic model, k = 1, responses of 6 tokens
decoded 2 per poll) with ``actor.generation.backend=vllm``, in single-process mode. Slow: it starts a vLLM engine;
skipped where vLLM is not installed. ``tests/test_vllm_backend.py`` checks the tokens themselves (the ones after a
load are the new weights', from keys and values recomputed over the tokens so far).
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")

from hybridflow.data import write_jsonl  # noqa: E402
from hybridflow.data.builtin import prompt_rows  # noqa: E402
from hybridflow.engine.vllm_rollout import VllmRollout  # noqa: E402

from test_async_streaming import DATASET_ROWS, TASK, _config, _first_epoch_exactly_once, _groups, _train  # noqa: E402

VLLM = ("actor.generation.backend=vllm", "actor.generation.vllm_kv_cache_gib=0.0625")


@pytest.mark.slow
def test_a_streaming_grpo_run_on_vllm_loads_weights_under_requests_in_flight_and_trains_every_prompt_once(
        tmp_path, monkeypatch):
    write_jsonl(tmp_path / "train.jsonl", prompt_rows(DATASET_ROWS, split="train", seed=0, config=TASK))
    in_flight_at_load: list[int] = []
    load = VllmRollout.load

    def recording_load(self, shard, *, version):
        in_flight_at_load.append(self.pending())
        return load(self, shard, version=version)

    monkeypatch.setattr(VllmRollout, "load", recording_load)
    history, trained = _train(_config(tmp_path, tmp_path / "run", *VLLM))

    assert len(in_flight_at_load) == 6 and in_flight_at_load[0] == 0  # one sync per step, the first before any
    # every later sync reaches requests mid-response: at most k x prompts_per_step groups of 2 samples in flight
    assert all(0 < pending <= 4 for pending in in_flight_at_load[1:])
    assert [metrics["async/weight_version"] for metrics in history] == [0, 1, 2, 3, 4, 5]
    for metrics in history:
        assert metrics["async/staleness_max"] <= 1
        assert sum(value for name, value in metrics.items() if name.startswith("async/staleness_count_")) == 4
        assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])
    assert any(metrics["async/multi_version_fraction"] > 0 for metrics in history)  # samples spanning two versions
    assert sum(metrics["async/stale_regenerated_groups"] for metrics in history) == 0
    assert all(count == 2 for count in _groups(trained).values())  # groups trained whole
    _first_epoch_exactly_once(trained)
