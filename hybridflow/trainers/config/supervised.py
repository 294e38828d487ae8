"""SFT and reward-model run configs (no torch: `hybridflow sft|rm` report config errors at once)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hybridflow.data.config import PromptFiles
from hybridflow.engine.config import EngineConfig
from hybridflow.models.config import ModelConfig
from hybridflow.trainers.config.rl import RUNTIMES, default_engine, require
from hybridflow.trainers.config.loader import apply_overrides, build_dataclass, load_yaml


@dataclass(frozen=True, kw_only=True)
class SupervisedData(PromptFiles):
    """Pair datasets (jsonl or parquet): the shared prompt-file keys plus the response length limit."""

    max_response_tokens: int = 256
    """Rows with longer responses (EOS included) are dropped (counted in a warning)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.max_response_tokens >= 1, "max_response_tokens", self.max_response_tokens, "an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class SFTData(SupervisedData):
    """Prompt/response rows."""

    response_key: str = "response"
    """Field with the target response."""


@dataclass(frozen=True, kw_only=True)
class PreferenceData(SupervisedData):
    """Prompt/chosen/rejected rows."""

    chosen_key: str = "chosen"
    """Field with the preferred response."""
    rejected_key: str = "rejected"
    """Field with the dispreferred response."""


@dataclass(frozen=True, kw_only=True)
class SupervisedRun:
    """Loop, devices and outputs shared by SFT and reward-model training."""

    model: ModelConfig
    """Initial weights (a local HF directory or a built-in tiny model)."""
    engine: EngineConfig = field(default_factory=lambda: default_engine(1e-4))
    """Layout, micro-batch budget, precision and optimizer (default lr 1e-4)."""
    batch_size: int = 16
    """Rows (SFT) or pairs (RM) per optimizer step, global."""
    epochs: int = 1
    """Passes over the training rows."""
    max_steps: int = 0
    """Stop after this many optimizer steps; 0 means epochs x (rows // batch_size)."""
    eval_every: int = 0
    """Evaluate every N optimizer steps (and at the end); 0: only at the end."""
    eval_before_train: bool = True
    """With a ``data.val_path``, evaluate once before the first step too, logged as step 0 (the starting score)."""
    devices: list[int] = field(default_factory=lambda: [1])
    """Devices per node of the training pool."""
    runtime: Literal["auto", "ray", "local"] = "auto"
    """``ray``: a Ray actor per device; ``local``: inside the command's process (``--local``); ``auto``: ``local``
    when ``devices`` is ``[1]`` and the driver is not connected to a Ray cluster, else ``ray``."""
    seed: int = 0
    """Seeds initialization (built-in models) and data order."""
    output_dir: str = "runs/supervised"
    """Metrics and the exported model (``<output_dir>/model``); a directory holding another run is refused
    unless ``overwrite``."""
    overwrite: bool = False
    """Delete the previous run in ``output_dir`` (each entry named on stdout) and start over."""
    progress_bar: bool = True
    """Show a tqdm progress bar when stderr is a terminal; otherwise one line every ``log_every`` steps."""
    log_every: int = 1
    """When stderr is not a terminal (or ``progress_bar`` is false): print one metrics line every N steps."""

    def __post_init__(self) -> None:
        require(self.log_every >= 1, "log_every", self.log_every, "an integer >= 1")
        require(self.batch_size >= 1, "batch_size", self.batch_size, "an integer >= 1")
        require(self.epochs >= 1, "epochs", self.epochs, "an integer >= 1")
        require(self.eval_every >= 0, "eval_every", self.eval_every, "an integer >= 0")
        require(self.max_steps >= 0, "max_steps", self.max_steps, "an integer >= 0")
        require(len(self.devices) > 0 and all(count >= 1 for count in self.devices), "devices", self.devices,
                 "a non-empty list of positive device counts per node")
        require(self.runtime in RUNTIMES, "runtime", self.runtime, ", ".join(RUNTIMES))
        data_parallel = sum(self.devices) // (self.engine.pp_size * self.engine.tp_size)
        require(self.batch_size % data_parallel == 0, "batch_size", self.batch_size,
                 f"a multiple of the data-parallel size {data_parallel}")


@dataclass(frozen=True, kw_only=True)
class SFTConfig(SupervisedRun):
    """``hybridflow sft``: next-token loss on the response tokens."""

    data: SFTData
    """Prompt/response rows."""
    val_function: str | None = None
    """A rule reward ``module:function`` (or ``file.py:function``, or a built-in name) scoring greedy answers to
    the ``data.val_path`` prompts at each evaluation: ``val/function_mean``, plus ``val/exact_match`` (answer ==
    the row's response, stripped). The answers are generated in this process with ``transformers`` from the
    current weights (meant for models that fit one device)."""
    val_max_new_tokens: int = 64
    """Longest greedy answer for ``val_function``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.val_max_new_tokens >= 1, "val_max_new_tokens", self.val_max_new_tokens, "an integer >= 1")
        if self.val_function is not None:
            require(self.data.val_path is not None, "val_function", self.val_function,
                    "null unless data.val_path is set (it scores answers to the validation prompts)")


@dataclass(frozen=True, kw_only=True)
class RMConfig(SupervisedRun):
    """``hybridflow rm``: Bradley-Terry loss on chosen/rejected pairs."""

    data: PreferenceData
    """Preference rows."""
    reward_type: Literal["score_head", "likelihood"] = "score_head"
    """``score_head``: a scalar head read at the last token; ``likelihood``: the reward is ``beta`` x the
    response's summed token log-probs under the model (its LM head is kept; DPO's loss without a reference)."""
    beta: float = 1.0
    """Scale of a likelihood reward model's score inside the Bradley-Terry loss."""
    nll_coef: float = 0.0
    """Likelihood reward models: weight of the chosen answers' token NLL added to the loss (keeps them likely)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.reward_type in ("score_head", "likelihood"), "reward_type", self.reward_type,
                 "'score_head' or 'likelihood'")
        require(self.beta > 0, "beta", self.beta, "a float > 0")
        require(self.nll_coef >= 0, "nll_coef", self.nll_coef, "a float >= 0")


def load_supervised_config(cls, path: str | None, overrides: list[str] = ()):
    """An SFTConfig or RMConfig from YAML and ``key=value`` overrides."""
    data = load_yaml(path) if path is not None else {}
    return build_dataclass(cls, apply_overrides(data, overrides, cls))
