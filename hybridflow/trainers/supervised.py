"""SFT and reward-model training: configs and the two short driver programs, writing Hugging Face directories.

Both run one worker group (``SFTWorker`` / ``PreferenceWorker``) on one pool, draw global batches
with a resumable seeded loader, evaluate on a held-out split (also before the first step), and export
the final weights plus the tokenizer to ``<output_dir>/model`` so ``hybridflow train`` can load them as
a ``path``. SFT with a ``val_function`` also scores greedy answers to the held-out prompts.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from hybridflow.controller import ResourcePool, WorkerGroup, runtime_mode
from hybridflow.data import BatchLoader, PreferenceDataset, SFTDataset
from hybridflow.trainers.build import engine_spec, tokenizer_of
from hybridflow.trainers.metrics import MetricsLogger, StepReporter
# the configs live in supervised_config (no torch); re-exported here for existing imports
from hybridflow.trainers.config.supervised import (PreferenceData, RMConfig, SFTConfig, SFTData,  # noqa: F401
                                                   SupervisedData, SupervisedRun, load_supervised_config)
from hybridflow.workers.supervised import PreferenceWorker, SFTWorker


def _datasets(config: SupervisedRun, tokenizer):
    common = dict(max_prompt_tokens=config.data.max_prompt_tokens, max_response_tokens=config.data.max_response_tokens,
                  **config.data.prompt_format())
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
                            **config.data.prompt_format())
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
        # a response prefix pre-started each answer in the prompt: the rule reads it whole
        prefixes = batch["response_prefix"] if "response_prefix" in batch else [""] * len(answers)
        scores.append(rule.score_batch(list(batch["raw_prompt"]), [p + a for p, a in zip(prefixes, answers)], fields))
        matches += [float(answer.strip() == str(row.get(config.data.response_key, "")).strip())
                    for answer, row in zip(answers, fields)]
    shutil.rmtree(scratch, ignore_errors=True)
    return {"val/function_mean": float(torch.cat(scores).mean()), "val/exact_match": sum(matches) / len(matches)}


def run_supervised(config: SFTConfig | RMConfig, *, mode: str | None = None, tensorboard: bool = True) -> dict:
    """Train, evaluate, export; returns ``{"history": [...], "model_dir": str, "final": metrics}``."""
    from hybridflow.trainers.preflight import check_model
    from hybridflow.trainers.run_dir import claim_run_directory

    if not isinstance(config, (SFTConfig, RMConfig)):
        raise ValueError(f"run_supervised needs an SFTConfig or RMConfig (load_supervised_config(SFTConfig, path, "
                         f"overrides) builds one), got a {type(config).__name__}")
    check_model("model", config.model, needs_tokenizer=True)  # before the tokenizer and the model load
    # one writer per directory and never two runs in it (there is no resume: a previous run needs `overwrite`)
    run_dir = claim_run_directory(config.output_dir, key="output_dir", overwrite_key="overwrite",
                                  overwrite=config.overwrite)
    try:
        return _train_and_export(config, mode=mode, tensorboard=tensorboard)
    finally:
        run_dir.release()


def _validation_reward(config: SFTConfig):
    """The ``val_function`` scorer (None without one); ValueError naming the key when it cannot be loaded."""
    if config.val_function is None:
        return None
    from hybridflow.rewards import RuleReward

    try:
        return RuleReward(config.val_function)
    except ValueError as error:
        raise ValueError(f"config key val_function: {error}") from None


def _train_and_export(config: SFTConfig | RMConfig, *, mode: str | None, tensorboard: bool) -> dict:
    is_sft = isinstance(config, SFTConfig)
    rule = _validation_reward(config) if is_sft else None  # a bad val_function is named before anything loads
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
    spec = engine_spec(config.model, config.engine, head=head, seed=config.seed, total_steps=total_steps)
    pool = ResourcePool(list(config.devices), mode=runtime_mode(config.runtime, [config.devices], mode=mode))
    if is_sft:
        group = WorkerGroup(pool, SFTWorker, spec, name="sft")
    else:
        group = WorkerGroup(pool, PreferenceWorker, spec, beta=config.beta, nll_coef=config.nll_coef, name="rm")
    loader = BatchLoader(train_data, batch_size=config.batch_size, seed=config.seed)
    output_dir = Path(config.output_dir)
    logger = MetricsLogger(output_dir, tensorboard=tensorboard)

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
