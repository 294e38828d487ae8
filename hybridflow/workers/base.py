"""ModelWorker: the part every role shares — build one engine from a spec, checkpoint it, export it."""

from __future__ import annotations

import torch

from hybridflow.controller import Worker, register
from hybridflow.controller.host import pin_num_threads
from hybridflow.engine.training import TrainingEngine
from hybridflow.protocol import DataProto
from hybridflow.workers.spec import EngineSpec

# Keys the engines read from a DataProto; everything else in the batch stays on the driver side.
SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def tensors_of(data: DataProto, keys: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """The DataProto's tensors as a plain dict (all of them, or ``keys``)."""
    names = list(data.batch.keys()) if keys is None else [key for key in keys if key in data.batch.keys()]
    return {name: data[name] for name in names}


ROLLOUT_TEMPERATURE = "rollout_temperature"
"""meta_info key of a rollout: the temperature its tokens were sampled at (1.0 for greedy). Log-probs of those
tokens (old, reference, the policy's in the loss) are of softmax(logits / temperature), the policy that sampled."""


def rollout_temperature(data: DataProto) -> float:
    """The sampling temperature recorded with ``data`` by the actor's rollout (1.0 if none: SFT rows, ptx)."""
    return float(data.meta_info.get(ROLLOUT_TEMPERATURE, 1.0))


def step_context(role: str, data: DataProto) -> str:
    """How a non-finite training step names where it happened: the role and the driver's RL step."""
    step = data.meta_info.get("step")
    return role if step is None else f"{role} at RL step {step},"


class ModelWorker(Worker):
    """Base of the role workers: one TrainingEngine over this worker group, checkpoint and export methods."""

    TRAINABLE = True
    """False for roles that only score (reference, reward, cost): their engine holds the weights in the
    compute dtype with no gradients or optimizer."""
    FP32_WEIGHTS: bool | None = None
    """Hold the weights in fp32 (None: when trainable); see ``TrainingEngine``'s ``fp32_weights``."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        if spec.engine.num_threads:
            pin_num_threads(spec.engine.num_threads)  # the driver's share of the node's cores no longer applies
        # a checkpoint is read shard by shard onto meta-initialised stages: no rank holds the whole model
        if spec.lora is not None and not self.TRAINABLE:
            raise ValueError(f"{type(self).__name__} was given a LoRA config, but it is a frozen role (never trained); "
                             f"LoRA applies to the trained roles: actor.lora, critic.lora")
        self.engine = TrainingEngine.from_model_config(spec.engine, spec.model, head=spec.head, seed=spec.seed,
                                                       total_steps=spec.total_steps, trainable=self.TRAINABLE,
                                                       lora=spec.lora, fp32_weights=self.FP32_WEIGHTS)
        self.set_parallel_layout(self.engine.layout)

    @register("ONE_TO_ALL")
    def save_checkpoint(self, directory: str) -> None:
        """Model, optimizer and step into ``directory`` (every rank writes its part)."""
        self.engine.save_checkpoint(directory)

    @register("ONE_TO_ALL")
    def load_checkpoint(self, directory: str) -> None:
        """Restore what ``save_checkpoint`` wrote (any layout)."""
        self.engine.load_checkpoint(directory)

    @register("ONE_TO_ALL")
    def export_hf(self, directory: str) -> None:
        """A Hugging Face model directory of the current weights (written by global rank 0)."""
        self.engine.export_hf(directory)

    @register("ONE_TO_ALL")
    def export_adapter(self, directory: str, base_model: str | None = None) -> None:
        """The LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors; global rank 0)."""
        self.engine.export_adapter(directory, base_model=base_model)

    @register("ONE_TO_ALL")
    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far."""
        return self.engine.step

    def _forward(self, data: DataProto, outputs: tuple[str, ...],
                 keys: tuple[str, ...] = SEQUENCE_KEYS) -> dict[str, torch.Tensor]:
        return self.engine.forward(tensors_of(data, keys), outputs=outputs, temperature=rollout_temperature(data))

    def _train_epochs(self, data: DataProto, *, keys: tuple[str, ...], loss_fn, outputs: tuple[str, ...],
                      ppo_epochs: int, mini_batch_size: int, seed: int, on_non_finite: str = "raise",
                      context: str = "") -> dict[str, float]:
        """Several epochs of optimizer steps over this rank's rows in shuffled mini-batches; mean metrics.

        ``mini_batch_size`` is global: each data-parallel rank takes mini_batch_size / dp of its rows
        per step, so every rank makes the same number of optimizer steps.
        """
        dp_size = self.engine.layout.dp_size
        local_mini_batch = mini_batch_size // dp_size
        batch = tensors_of(data, keys)
        num_rows = len(data)
        assert local_mini_batch >= 1 and num_rows % local_mini_batch == 0, (num_rows, local_mini_batch)
        generator = torch.Generator().manual_seed(seed)
        totals: dict[str, float] = {}
        count = 0
        for _ in range(ppo_epochs):
            order = torch.randperm(num_rows, generator=generator)
            for start in range(0, num_rows, local_mini_batch):
                rows = order[start:start + local_mini_batch]
                metrics = self.engine.train_step({k: v[rows] for k, v in batch.items()}, loss_fn, outputs=outputs,
                                                 on_non_finite=on_non_finite, context=context,
                                                 temperature=rollout_temperature(data))
                for name, value in metrics.items():
                    totals[name] = totals.get(name, 0.0) + value
                count += 1
        return {name: value / count for name, value in totals.items()}
