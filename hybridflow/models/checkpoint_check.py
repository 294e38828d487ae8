"""What a model directory's weights hold, read from safetensors headers only (no tensor is loaded), and how that
compares with its config.json and its tokenizer: the checks a run makes before it builds a model.

``weight_shapes(directory)`` maps tensor names to shapes (single file or sharded with an index);
``weights_vs_config`` names unexpected, missing and misshapen tensors against the architecture config.json
describes (instantiated on the meta device: no memory, no weights); ``tokenizer_size`` reads the largest token
id of a tokenizer.json / vocab.json.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

# heads that a checkpoint may have or lack depending on what it was trained as (reported elsewhere)
HEAD_PREFIXES = ("lm_head.", "score.")
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of one safetensors file (tensor name -> {dtype, shape, data_offsets}), metadata dropped."""
    with path.open("rb") as handle:
        length = struct.unpack("<Q", handle.read(8))[0]
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


def weight_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of the directory's ``*.safetensors`` files (name -> shape); {} when it has none."""
    shapes = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        for name, entry in read_safetensors_header(path).items():
            if isinstance(entry, dict) and "shape" in entry:
                shapes[name] = tuple(entry["shape"])
    return shapes


def layer_count(names) -> int:
    """1 + the largest ``layers.N.`` index among tensor names (0 when there is none)."""
    indices = [int(match.group(1)) for name in names for match in [LAYER_INDEX.search(name)] if match]
    return max(indices) + 1 if indices else 0


def _expected_shapes(config_file: Path) -> dict[str, tuple[int, ...]] | None:
    """Parameter shapes of the causal LM config.json describes (meta device); None when transformers cannot
    build it (an unknown family is reported when the model loads)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(config_file.parent))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # an unsupported family or a config transformers rejects: the loader says which
        return None
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def weights_vs_config(directory: str | Path) -> str | None:
    """Why the weights in ``directory`` do not fit the model its config.json describes (None when they do)."""
    directory = Path(directory)
    found = weight_shapes(directory)
    if not found:
        return None
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    declared = config.get("num_hidden_layers")
    in_weights = layer_count(found)
    if isinstance(declared, int) and in_weights and in_weights != declared:
        return (f"config.json says num_hidden_layers={declared} but the weights hold {in_weights} layers "
                f"({'the extra layers would be silently dropped' if in_weights > declared else 'layers are missing'})")
    expected = _expected_shapes(directory / "config.json")
    if expected is None:
        return None
    # the stored names may carry the backbone's prefix or not (a ForTokenClassification export stores model.*)
    body = {name: shape for name, shape in found.items() if not name.startswith(HEAD_PREFIXES)}
    wanted = {name: shape for name, shape in expected.items() if not name.startswith(HEAD_PREFIXES)}
    body = _stack_expert_shapes(body, wanted)
    unexpected = sorted(set(body) - set(wanted))
    missing = sorted(set(wanted) - set(body))
    if unexpected:
        return f"the weights hold tensors the config.json model does not have: {_listed(unexpected)}"
    if missing:
        return f"the weights lack tensors the config.json model needs: {_listed(missing)}"
    wrong = [f"{name} {list(body[name])} (config.json implies {list(wanted[name])})" for name in sorted(body)
             if body[name] != wanted[name]]
    if wrong:
        return f"tensor shapes differ from config.json: {_listed(wrong)}"
    return None


def _stack_expert_shapes(body: dict[str, tuple[int, ...]], wanted) -> dict[str, tuple[int, ...]]:
    """``body`` with per-expert tensors (``mlp.experts.<e>.gate_proj.weight``, as hub MoE checkpoints store them)
    read as the stacked parameters the model holds (``mlp.experts.gate_up_proj`` [E, ...]), as the loader stacks
    them (``models/moe.py``)."""
    from hybridflow.models.moe import per_expert_names

    body = dict(body)
    for name in sorted(set(wanted) - set(body)):
        experts = per_expert_names(name, body)
        if experts is None:
            continue
        parts = [[body.pop(part) for part in expert] for expert in experts]
        body[name] = (len(parts), sum(shape[0] for shape in parts[0]), *parts[0][0][1:])
    return body


def tokenizer_size(directory: str | Path) -> int | None:
    """1 + the largest token id of the tokenizer in ``directory`` (tokenizer.json, else vocab.json); None when it
    has neither or they cannot be read."""
    directory = Path(directory)
    ids: list[int] = []
    try:
        if (directory / "tokenizer.json").is_file():
            data = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
            vocab = (data.get("model") or {}).get("vocab")
            if isinstance(vocab, dict):
                ids += [value for value in vocab.values() if isinstance(value, int)]
            elif isinstance(vocab, list):  # Unigram: a list of [piece, score]; ids are positions
                ids.append(len(vocab) - 1)
            ids += [token["id"] for token in data.get("added_tokens") or [] if isinstance(token.get("id"), int)]
        elif (directory / "vocab.json").is_file():
            ids += list(json.loads((directory / "vocab.json").read_text(encoding="utf-8")).values())
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    numbers = [value for value in ids if isinstance(value, int)]
    return max(numbers) + 1 if numbers else None


def has_score_head(directory: str | Path) -> bool:
    """Whether the weights in ``directory`` include a trained scalar head (``score.*``)."""
    return any(name.split(".")[0] == "score" for name in weight_shapes(directory))
