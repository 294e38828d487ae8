"""SFT and reward-model training: configs and the two short driver programs, writing Hugging Face directories.

Both run one worker group (``SFTWorker`` / ``PreferenceWorker``) on one pool, draw global batches
with a resumable seeded loader, evaluate on a held-out split (also before the first step), and export
the final weights plus the tokenizer to ``<output_dir>/model`` so ``hybridflow train`` can load them as
a ``path``. SFT with a ``val_function`` also scores greedy answers to the held-out prompts.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from hybridflow.controller import ResourcePool, WorkerGroup
from hybridflow.data import BatchLoader, PreferenceDataset, SFTDataset
from hybridflow.data.config import PromptFiles
from hybridflow.engine.config import EngineConfig
from hybridflow.models.config import ModelConfig
from hybridflow.trainers.build import engine_config_of, model_config_of, tokenizer_of
from hybridflow.trainers.config import default_engine, require
from hybridflow.trainers.config_loader import apply_overrides, build_dataclass, load_yaml
from hybridflow.trainers.metrics import MetricsLogger, StepReporter
from hybridflow.workers import EngineSpec
from hybridflow.workers.supervised import PreferenceWorker, SFTWorker


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
    seed: int = 0
    """Seeds initialization (built-in models) and data order."""
    output_dir: str = "runs/supervised"
    """Metrics and the exported model (``<output_dir>/model``)."""
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
    return build_dataclass(cls, apply_overrides(data, list(overrides)))


def _datasets(config: SupervisedRun, tokenizer):
    common = dict(max_prompt_tokens=config.data.max_prompt_tokens, max_response_tokens=config.data.max_response_tokens,
                  prompt_key=config.data.prompt_key)
    if isinstance(config, SFTConfig):
        make = lambda path: SFTDataset(path, tokenizer, response_key=config.data.response_key, **common)  # noqa: E731
    else:
        make = lambda path: PreferenceDataset(path, tokenizer, chosen_key=config.data.chosen_key,  # noqa: E731
                                              rejected_key=config.data.rejected_key, **common)
    return make(config.data.train_path), (make(config.data.val_path) if config.data.val_path else None)


def _evaluate(config: SupervisedRun, group: WorkerGroup, dataset) -> dict[str, float]:
    parts = [group.evaluate(dataset.batch(range(start, min(start + config.batch_size, len(dataset)))))
             for start in range(0, len(dataset), config.batch_size)]
    if isinstance(config, SFTConfig):
        nll = sum(float(p["nll_sum"].sum()) for p in parts) / sum(float(p["num_tokens"].sum()) for p in parts)
        return {"val/nll": nll}
    margins = torch.cat([p["chosen_scores"] - p["rejected_scores"] for p in parts])
    return {"val/accuracy": float((margins > 0).float().mean()), "val/margin": float(margins.mean())}


def _greedy_answer_metrics(config: SFTConfig, group: WorkerGroup, tokenizer, rule, output_dir: Path) -> dict[str, float]:
    """``val/function_mean`` and ``val/exact_match`` of greedy answers to the validation prompts, generated with
    transformers from the group's current weights (exported to a scratch directory)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from hybridflow.data import PromptDataset

    transformers_logging.disable_progress_bar()  # a "Loading weights" bar per evaluation would flood the log

    scratch = output_dir / "eval_model.tmp"
    group.export_hf(str(scratch))
    model = AutoModelForCausalLM.from_pretrained(str(scratch)).eval()
    prompts = PromptDataset(config.data.val_path, tokenizer, max_prompt_tokens=config.data.max_prompt_tokens,
                            prompt_key=config.data.prompt_key)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    scores, matches = [], []
    for batch in prompts.batches_in_order(config.batch_size):
        input_ids_BP = batch["input_ids"]
        with torch.no_grad():
            output_BS = model.generate(input_ids=input_ids_BP, attention_mask=batch["attention_mask"], do_sample=False,
                                       max_new_tokens=config.val_max_new_tokens, pad_token_id=pad_id,
                                       eos_token_id=tokenizer.eos_token_id)
        answers = tokenizer.batch_decode(output_BS[:, input_ids_BP.shape[1]:], skip_special_tokens=True)
        fields = list(batch["extra_fields"])
        scores.append(rule.score_batch(list(batch["raw_prompt"]), answers, fields))
        matches += [float(answer.strip() == str(row.get(config.data.response_key, "")).strip())
                    for answer, row in zip(answers, fields)]
    shutil.rmtree(scratch, ignore_errors=True)
    return {"val/function_mean": float(torch.cat(scores).mean()), "val/exact_match": sum(matches) / len(matches)}


def run_supervised(config: SFTConfig | RMConfig, *, mode: str | None = None, tensorboard: bool = True) -> dict:
    """Train, evaluate, export; returns ``{"history": [...], "model_dir": str, "final": metrics}``."""
    is_sft = isinstance(config, SFTConfig)
    from hybridflow.trainers.preflight import check_model

    check_model("model", config.model, needs_tokenizer=True)  # before the tokenizer and the model load
    tokenizer = tokenizer_of(config.model).load()
    train_data, val_data = _datasets(config, tokenizer)
    if config.batch_size > len(train_data):
        raise ValueError(f"config key batch_size got {config.batch_size}; allowed: at most the "
                         f"{len(train_data)} training rows of {config.data.train_path}")
    steps_per_epoch = len(train_data) // config.batch_size
    total_steps = steps_per_epoch * config.epochs
    if config.max_steps:
        total_steps = min(total_steps, config.max_steps)
    head = "lm" if is_sft or config.reward_type == "likelihood" else "score"
    spec = EngineSpec(model=model_config_of(config.model, head=head, seed=config.seed),
                      engine=engine_config_of(config.engine, seed=config.seed, optimizer_steps=total_steps))
    pool = ResourcePool(list(config.devices), mode=mode)
    if is_sft:
        group = WorkerGroup(pool, SFTWorker, spec, name="sft")
    else:
        group = WorkerGroup(pool, PreferenceWorker, spec, beta=config.beta, nll_coef=config.nll_coef, name="rm")
    loader = BatchLoader(train_data, batch_size=config.batch_size, seed=config.seed)
    output_dir = Path(config.output_dir)
    logger = MetricsLogger(output_dir, tensorboard=tensorboard)
    rule = None
    if is_sft and config.val_function is not None:
        from hybridflow.rewards import RuleReward

        rule = RuleReward(config.val_function)

    def evaluate() -> dict[str, float]:
        started = time.perf_counter()
        metrics = _evaluate(config, group, val_data)
        if rule is not None:
            metrics.update(_greedy_answer_metrics(config, group, tokenizer, rule, output_dir))
        metrics["time/validate_s"] = time.perf_counter() - started
        return metrics

    reporter = StepReporter("sft" if is_sft else "rm", total=total_steps, progress_bar=config.progress_bar,
                            every=config.log_every, keys=("loss",))
    try:
        final: dict[str, float] = {}
        if val_data is not None and config.eval_before_train:
            final = evaluate()
            logger.log(0, final)
            reporter.update(0, final, advance=False)
        for step in range(1, total_steps + 1):
            started = time.perf_counter()
            metrics = group.train_batch(loader.next_batch())[0]
            if val_data is not None and (step == total_steps or (config.eval_every and step % config.eval_every == 0)):
                metrics.update(evaluate())
            metrics["time/step_s"] = time.perf_counter() - started
            logger.log(step, metrics)
            final = metrics
            reporter.update(step, metrics)
        model_dir = output_dir / "model"
        group.export_hf(str(model_dir))
        tokenizer.save_pretrained(str(model_dir))
    finally:
        reporter.close()
        logger.close()
        group.shutdown()
        pool.release()
    return {"history": logger.history, "model_dir": str(model_dir), "final": final}
