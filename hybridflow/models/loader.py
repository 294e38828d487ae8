"""build_model: a Hugging Face causal LM, or its backbone with a scalar head, from a local directory or a tiny config."""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, PretrainedConfig
from transformers.utils import logging as transformers_logging

from hybridflow.models.config import HEADS, ModelConfig
from hybridflow.models.families import LM_ONLY_FAMILIES, family_of
from hybridflow.models.moe import GROUPED_EXPERTS
from hybridflow.models.heads import SCALAR_HEAD, init_scalar_head
from hybridflow.models.tiny import seeded_init, tiny_config


def load_hf_config(path: str, *, trust_remote_code: bool = False) -> PretrainedConfig:
    """The Hugging Face config of the local model directory ``path``; ValueError if it is not one."""
    if not os.path.isdir(path):
        raise ValueError(f"model directory {path!r} does not exist (a local Hugging Face model directory "
                         f"is expected; nothing is downloaded)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model directory {path!r} has no config.json, so it is not a Hugging Face model directory")
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def hf_config_of(config: ModelConfig, *, head: str = "lm") -> PretrainedConfig:
    """The Hugging Face config ``build_model(config, head=head)`` builds (family checked, head fields set)."""
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    if config.tiny is not None:
        hf_config = tiny_config(config.family or "llama", **config.tiny)
        source = "tiny config"
    else:
        hf_config = load_hf_config(config.path, trust_remote_code=config.trust_remote_code)
        source = config.path
    family = family_of(hf_config, source=source)
    if config.family is not None and config.family != family:
        raise ValueError(f"ModelConfig.family is {config.family!r} but {source} holds a {family!r} model")
    if head != "lm" and family in LM_ONLY_FAMILIES:
        raise ValueError(f"head {head!r} (a critic, reward or cost model) needs a token-classification model, which "
                         f"transformers does not have for {family!r} ({source}); allowed: head 'lm' (actor, "
                         f"reference), or a backbone of another family for the scalar head")
    if head != "lm":
        hf_config.num_labels = 1
        hf_config.classifier_dropout = 0.0  # transformers defaults to 0.1; a critic/reward must be deterministic
    return hf_config


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype parameters are built in: "auto" is fp32 on every device.

    fp32 because the engines keep fp32 master weights: loading a checkpoint in bf16 first would round
    its weights before the upcast, and CPU and GPU runs of one config would start from different
    weights. Low-precision compute comes from the engine's dtype (autocast), not from here.
    """
    return torch.float32 if name == "auto" else getattr(torch, name)


def build_model(config: ModelConfig, *, head: str = "lm", seed: int = 0,
                device: str | torch.device = "cpu") -> torch.nn.Module:
    """Build the model ``config`` describes with ``head`` (the role's, ``HEADS``) on ``device``, in eval mode
    (training engines call ``.train()``).

    - head "lm": ``*ForCausalLM``; "value"/"score": ``*ForTokenClassification`` with one label
      (a Linear(H, 1) named ``score`` on the last hidden states, dropout 0).
    - ``config.path``: weights from the directory. A value/score model loads from its own checkpoint
      (head restored) or from a causal-LM checkpoint (new head, seeded by ``seed``). Weights the
      head needs but the checkpoint lacks are an error, never silently random.
    - ``config.tiny``: random weights from ``seed`` (the run's), bit-identical on every rank.
    - ``device="meta"``: the architecture only, no weights read (shard it, then materialise/load).
    """
    hf_config = hf_config_of(config, head=head)
    dtype = resolve_dtype(config.dtype)
    model_cls = AutoModelForCausalLM if head == "lm" else AutoModelForTokenClassification
    kwargs = {"dtype": dtype, "attn_implementation": config.attn_implementation,
              "trust_remote_code": config.trust_remote_code}
    if getattr(hf_config, "num_experts", 0):  # mixture of experts: one grouped computation (models/moe.py)
        kwargs["experts_implementation"] = GROUPED_EXPERTS
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return model_cls.from_config(hf_config, **kwargs).eval()
    if config.tiny is not None:
        with seeded_init(seed):
            model = model_cls.from_config(hf_config, **kwargs)
        new_head = head != "lm"
    else:
        with _quiet_transformers(head != "lm"):  # _check_loaded reports a new head (and raises on gaps)
            model, info = model_cls.from_pretrained(config.path, config=hf_config, output_loading_info=True, **kwargs)
        new_head = _check_loaded(config, model, info["missing_keys"], head=head, seed=seed)
    if new_head:
        init_scalar_head(getattr(model, SCALAR_HEAD), seed=seed)
    return model.to(device).eval()


@contextlib.contextmanager
def _quiet_transformers(quiet: bool):
    """No per-load progress bar; with ``quiet`` also no load report (an LM checkpoint under a scalar head
    lists lm_head and score, which ``_check_loaded`` reports in one line)."""
    previous = transformers_logging.get_verbosity()
    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    if quiet:
        transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(previous)
        if bars:
            transformers_logging.enable_progress_bar()


def _check_loaded(config: ModelConfig, model: torch.nn.Module, missing_keys: list[str], *, head: str,
                  seed: int) -> bool:
    """Raise if the checkpoint lacked weights other than a new scalar head; True if the head is new."""
    missing = set(missing_keys)
    if getattr(model.config, "tie_word_embeddings", False):
        missing.discard("lm_head.weight")  # tied to the input embedding, which was loaded
    head_keys = {name for name in missing if name.split(".")[0] == SCALAR_HEAD}
    other = sorted(missing - head_keys)
    if other:
        shown = other[:5] + (["..."] if len(other) > 5 else [])
        raise ValueError(f"checkpoint {config.path!r} lacks weights that head {head!r} needs: {shown}"
                         f" (an 'lm' model needs lm_head unless the embeddings are tied)")
    if head_keys and head != "lm":
        warnings.warn(f"{config.path!r} has no {head} head: initialising a new one from seed {seed}",
                      stacklevel=3)
        return True
    return False
