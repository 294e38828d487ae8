"""PPO on Ray with every role on two ranks: a 3d actor resharded by the 3D-HybridEngine vs one rank.

The multi-rank runs use one pool of two slots (one test: four) holding all four roles: the actor
trains under the ``3d`` layout (tp 2, or pp 2) and generates through the 3D-HybridEngine
(generation tp 1: two replicas, each given half the prompts by ``3D_ALL_MICRO_DP``); the critic,
reference and reward model run under ``fsdp`` with dp 2. Each run is compared with the same config on one rank (pool
``[1]``, every layout ``fsdp``).

Why the runs can be compared at all:
- generation is greedy (``actor.generation.greedy=true``). Sampling could not match: each
  generation replica draws from its own seeded stream (seed + replica index), so two replicas
  sample different noise than one replica does for the same prompts;
- ``batch.mini_batch_size`` equals the samples of a step (one optimizer step per epoch). With
  several mini-batches the rows of a mini-batch are drawn per data-parallel rank from that rank's
  share, so dp 2 and dp 1 would update on different row subsets (both correct, not equal);
- the losses are token sums over global normalizers (docs/engines.md), so the gradient does not
  depend on how rows are split over ranks and micro-batches;
- the few metrics that are means of per-micro-batch means (``critic/values_mean``,
  ``actor/clip_fraction``, ...) equal the global mean only when the micro-batches hold equally many
  response tokens: here every greedy response of the random tiny model runs to ``max_new_tokens``
  (checked), and each rank's rows fit one micro-batch except under pp 2 (where those metrics are
  0 up to rounding in both runs: one update per step, so the PPO ratio is 1).
What remains is fp32 rounding: tensor parallelism sums row-parallel partial products in another
order, FSDP reduce-scatters gradients over two ranks. Each such sum differs by a few ulps (~1e-7
relative); measured over two PPO steps the metrics differ by at most ~5e-7 relative (grad norms,
KL) and the whitened, zero-mean quantities (advantage mean, policy loss) by ~1e-6 absolute. The
metric bound below (1e-5 relative and absolute) is ~20x that and still far below any real
difference (a single response token generated differently changes the rewards, KL and grad norms at
1e-2). Final weights: Adam divides each element's gradient by its own running RMS, so an element
whose gradient is near Adam's eps has its rounding amplified; measured, a handful of ~300k elements
differ by up to 2e-5 after two steps, while every step moves weights by up to lr = 1e-3. The weight
bound is lr / 10, and the test checks that the weights moved by more than 10x that bound.
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.engine.weights import read_safetensors
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import RLTrainer

TRAINED_ROLES = ("actor", "critic")
# Actor training layouts for a two-slot pool (the critic, reference and reward stay fsdp: dp 2).
TP2 = ("actor.engine.layout=3d", "actor.engine.tp_size=2")
PP2 = ("actor.engine.layout=3d", "actor.engine.pp_size=2", "actor.engine.micro_batch_tokens=64")
REL, ABS = 1e-5, 1e-5
LR = 1e-3
MAX_NEW_TOKENS = 4
WEIGHT_ATOL = LR / 10


def character_reward(prompt: str, response: str, **extra_fields) -> float:
    """A rule reward that varies with the response (the score model alone is near-constant)."""
    return sum(ord(char) for char in response) % 7 / 7.0


@pytest.fixture(scope="module")
def train_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("multirank_data") / "train.jsonl"
    write_jsonl(path, prompt_rows(16, split="train", seed=0, config=ArithmeticTaskConfig(max_digits=1)))
    return path


def _train(train_path, directory, *overrides: str, export_before: bool = False):
    """Two greedy PPO steps on Ray: (history, {role: HF weights before} or None, {role: HF weights after}, meshes)."""
    config = load_rl_config(None, [
        f"data.train_path={train_path}", "actor.model.builtin=arithmetic", "reward.model.builtin=arithmetic",
        f"reward.function={__file__}:character_reward", f"actor.generation.max_new_tokens={MAX_NEW_TOKENS}",
        "actor.generation.greedy=true", f"actor.engine.optim.lr={LR}", f"critic.engine.optim.lr={LR}",
        "batch.prompts_per_step=4", "batch.samples_per_prompt=2", "batch.mini_batch_size=8",
        "trainer.total_steps=2", "trainer.progress_bar=false", "trainer.resume=false",
        f"trainer.output_dir={directory / 'run'}", *overrides])
    trainer = RLTrainer(config, mode="ray", tensorboard=False)
    try:
        meshes = {role: group.mesh for role, group in trainer.groups.items()}
        before = {role: _export(trainer, role, directory / f"{role}_before") for role in TRAINED_ROLES} \
            if export_before else None
        history = trainer.fit()
        after = {role: _export(trainer, role, directory / f"{role}_after") for role in TRAINED_ROLES}
    finally:
        trainer.shutdown()
    return history, before, after, meshes


def _export(trainer: RLTrainer, role: str, directory) -> dict[str, torch.Tensor]:
    trainer.groups[role].export_hf(str(directory))
    return read_safetensors(str(directory))  # one file per pipeline stage under pp > 1


def _layout_dependent(names: set[str]) -> set[str]:
    """The weight transition's figures (bytes received, parameter memory, collectives) and the token budgets an
    auto budget resolves to (per rank memory): they describe the layout, so they differ from one rank's by design;
    the rollout/training log-prob mismatch does not, and is compared."""
    mismatch = {"rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max", "rollout/sequence_kl"}
    return {name for name in names if (name.startswith("rollout/") and name not in mismatch)
            or name.endswith("/token_budget")}


def _assert_same_metrics(history: list[dict], expected: list[dict]) -> None:
    assert [record["step"] for record in history] == [record["step"] for record in expected] == [1, 2]
    assert all(record["response/length_min"] == MAX_NEW_TOKENS for record in expected), \
        "equal-length responses are a precondition of comparing micro-batch-averaged metrics (module docstring)"
    for record, reference in zip(history, expected):
        names = {name for name in reference if not name.startswith("time/")}
        assert names == {name for name in record if not name.startswith("time/")}
        for name in sorted(names - _layout_dependent(names)):
            assert record[name] == pytest.approx(reference[name], rel=REL, abs=ABS), (record["step"], name)


def _assert_same_weights(weights: dict[str, dict[str, torch.Tensor]],
                         expected: dict[str, dict[str, torch.Tensor]]) -> None:
    for role in TRAINED_ROLES:
        assert weights[role].keys() == expected[role].keys(), role
        for name, tensor in expected[role].items():
            torch.testing.assert_close(weights[role][name], tensor, rtol=0, atol=WEIGHT_ATOL, msg=f"{role} {name}")


@pytest.fixture(scope="module")
def one_rank(ray_session, train_path, tmp_path_factory):
    """The same run on one slot, every role fsdp (the reference the multi-rank runs must equal)."""
    history, before, after, _ = _train(train_path, tmp_path_factory.mktemp("one_rank"), "placement.pools={all: [1]}",
                                       export_before=True)
    return history, before, after


@pytest.mark.slow
def test_3d_tp2_actor_with_two_generation_replicas_updates_everything_and_equals_one_rank(
        ray_session, train_path, tmp_path, one_rank):
    history, before, after, meshes = _train(train_path, tmp_path, "placement.pools={all: [2]}", *TP2,
                                            "actor.hybrid_engine.tp_size=1", export_before=True)
    actor_mesh = meshes["actor"]
    assert (actor_mesh.layout.tp_size, actor_mesh.layout.pp_size, actor_mesh.layout.dp_size) == (2, 1, 1)
    assert actor_mesh.generation.num_replicas == 2
    for role in ("critic", "reference", "reward"):
        assert meshes[role].layout.dp_size == 2, role
    one_rank_history, one_rank_before, one_rank_after = one_rank
    for role in TRAINED_ROLES:
        unchanged = [name for name, tensor in before[role].items() if torch.equal(tensor, after[role][name])]
        assert unchanged == [], f"{role} parameters not updated: {unchanged}"
        # both runs start from the same weights, and the updates are far larger than the tolerance
        for name, tensor in before[role].items():
            assert torch.equal(tensor, one_rank_before[role][name]), (role, name)
        moved = max(float((after[role][name] - tensor).abs().max()) for name, tensor in before[role].items())
        assert moved > 10 * WEIGHT_ATOL, role
    assert history[1]["kl/sequence_kl"] > 1e-3  # the actor moved away from the reference
    _assert_same_metrics(history, one_rank_history)
    _assert_same_weights(after, one_rank_after)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    pytest.param(TP2 + ("actor.hybrid_engine.tp_size=1", "actor.hybrid_engine.strategy=vanilla"), id="tp2-vanilla-grouping"),
    pytest.param(TP2 + ("actor.hybrid_engine.tp_size=1", "actor.hybrid_engine.strategy=full_gather"),
                 id="tp2-full-gather-baseline"),
    pytest.param(TP2 + ("actor.hybrid_engine.tp_size=2",), id="tp2-tensor-parallel-generation"),
    pytest.param(PP2 + ("actor.hybrid_engine.pp_size=1",), id="pp2-two-generation-replicas"),
    pytest.param(PP2 + ("actor.hybrid_engine.pp_size=2",), id="pp2-pipelined-generation"),
])
def test_other_two_rank_actor_layouts_equal_one_rank(ray_session, train_path, tmp_path, one_rank, layout):
    history, _, after, _ = _train(train_path, tmp_path, "placement.pools={all: [2]}", *layout)
    one_rank_history, _, one_rank_after = one_rank
    _assert_same_metrics(history, one_rank_history)
    _assert_same_weights(after, one_rank_after)


@pytest.mark.slow
def test_two_rank_fsdp_actor_gathers_its_slices_in_a_counted_transition_and_equals_one_rank(
        ray_session, train_path, tmp_path, one_rank):
    """The default fsdp actor over two ranks: each generates alone after all-gathering the other rank's slices,
    which the transition counts (one rank alone moves nothing)."""
    history, _, after, meshes = _train(train_path, tmp_path, "placement.pools={all: [2]}")
    assert meshes["actor"].layout.dp_size == 2 and meshes["actor"].generation.num_replicas == 2
    one_rank_history, _, one_rank_after = one_rank
    assert all(record["rollout/bytes_received"] > 0 and record["rollout/collectives"] >= 1 for record in history)
    assert all(record["rollout/bytes_received"] == 0 for record in one_rank_history)
    _assert_same_metrics(history, one_rank_history)
    _assert_same_weights(after, one_rank_after)


@pytest.mark.slow
def test_four_rank_actor_with_tp2_and_dp2_equals_one_rank(ray_session, train_path, tmp_path, one_rank):
    """tp 2 x dp 2: four generation replicas, and DP_METRICS/3D_PROTO over two actor data-parallel groups."""
    history, _, after, meshes = _train(train_path, tmp_path, "placement.pools={all: [4]}", *TP2,
                                       "actor.hybrid_engine.tp_size=1")
    assert meshes["actor"].layout.dp_size == 2 and meshes["actor"].generation.num_replicas == 4
    one_rank_history, _, one_rank_after = one_rank
    _assert_same_metrics(history, one_rank_history)
    _assert_same_weights(after, one_rank_after)


@pytest.mark.slow
def test_checkpoint_of_a_two_rank_run_resumes_on_one_rank_identically(ray_session, train_path, tmp_path, one_rank):
    """Step 1 on two ranks (3d tp2 actor, fsdp dp2 critic) saved; step 2 resumed on one rank (fsdp)."""
    first, _, _, _ = _train(train_path, tmp_path / "first", "placement.pools={all: [2]}", *TP2,
                            "trainer.total_steps=1", "trainer.save_every=1")
    (tmp_path / "second").mkdir()
    history, _, after, _ = _train(train_path, tmp_path / "second", "placement.pools={all: [1]}",
                                  f"trainer.output_dir={tmp_path / 'first' / 'run'}", "trainer.resume=true")
    assert history[0] == first[0]  # step 1 is the two-rank run's record (its timings too): it resumed
    one_rank_history, _, one_rank_after = one_rank
    _assert_same_metrics(history, one_rank_history)
    _assert_same_weights(after, one_rank_after)
