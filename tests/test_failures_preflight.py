"""What preflight knows before a model is built: weights against config.json, the tokenizer against the vocabulary,
token ids, a reward model without a score head, a reward module that exits at import, duplicate keys, files of
the wrong kind, and options the rest of the config makes inert."""

from __future__ import annotations

import gzip
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from hybridflow.cli import main
from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ASSETS_DIR
from hybridflow.data.files import read_rows
from hybridflow.trainers.config.loader import load_yaml
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.preflight import inert_options, preflight, warn_local_pools


def _save_model(directory, *, layers: int | None = None, head: str = "lm", config_changes: dict | None = None,
                vocab_size: int | None = None):
    """A Hugging Face directory with the built-in task's tokenizer, config.json (changed by ``config_changes``)
    and weights of a model with ``layers`` decoder layers (default: what config.json says)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    shutil.copytree(ASSETS_DIR, directory)
    config = AutoConfig.from_pretrained(directory)
    if layers is not None:
        config.num_hidden_layers = layers
    if head == "score":
        config.num_labels = 1
    if vocab_size is not None:
        config.vocab_size = vocab_size
    model = (AutoModelForCausalLM if head == "lm" else AutoModelForTokenClassification).from_config(config)
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()},
              str(directory / "model.safetensors"))
    if config_changes:
        data = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**data, **config_changes}))
    return directory


@pytest.fixture
def prompts(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+2="}, {"prompt": "3+4="}])


def _config(tmp_path, *overrides):
    return load_rl_config(None, [f"data.train_path={tmp_path / 'train.jsonl'}", "actor.model.builtin=arithmetic",
                                 "reward.function=arithmetic", "actor.generation.max_new_tokens=4",
                                 "batch.prompts_per_step=2", "batch.mini_batch_size=2",
                                 f"trainer.output_dir={tmp_path / 'run'}", *overrides])


def test_a_config_json_with_fewer_layers_than_the_weights_is_refused_not_truncated(tmp_path, prompts):
    model = _save_model(tmp_path / "model", layers=4, config_changes={"num_hidden_layers": 2})
    with pytest.raises(ValueError) as caught:
        preflight(_config(tmp_path, f"actor.model.path={model}", "actor.model.builtin=null"))
    assert str(caught.value) == (
        f"config key actor.model.path: model directory '{model}': config.json says num_hidden_layers=2 but the weights "
        f"hold 4 layers (the extra layers would be silently dropped); re-export the model or fix its config.json")


def test_weights_with_tensors_or_shapes_config_json_does_not_describe_are_refused(tmp_path, prompts):
    model = _save_model(tmp_path / "model", config_changes={"intermediate_size": 256})
    with pytest.raises(ValueError, match=r"config key actor\.model\.path: model directory '.*': tensor shapes differ "
                                         r"from config\.json: model\.layers\.0\.mlp\.down_proj\.weight \[128, 384\] "
                                         r"\(config\.json implies \[128, 256\]\)"):
        preflight(_config(tmp_path, f"actor.model.path={model}", "actor.model.builtin=null"))
    other = _save_model(tmp_path / "other", config_changes={"attention_bias": True})
    with pytest.raises(ValueError, match=r"the weights lack tensors the config\.json model needs: "
                                         r"model\.layers\.0\.self_attn\.k_proj\.bias"):
        preflight(_config(tmp_path, f"actor.model.path={other}", "actor.model.builtin=null"))


def test_a_model_whose_vocabulary_is_smaller_than_its_tokenizer_is_refused_up_front(tmp_path, prompts):
    model = _save_model(tmp_path / "model", vocab_size=16, config_changes={"vocab_size": 16})
    with pytest.raises(ValueError) as caught:
        preflight(_config(tmp_path, f"actor.model.path={model}", "actor.model.builtin=null"))
    assert str(caught.value) == ("config key actor.model.path: the tokenizer has token ids up to 20 but the model in "
                                 "actor.model.path has vocab_size=16 (config.json): ids >= 16 have no embedding; use "
                                 "the model's own tokenizer")


def test_suppressed_or_stop_token_ids_beyond_the_vocabulary_are_refused(tmp_path, prompts):
    model = _save_model(tmp_path / "model")
    own = (f"actor.model.path={model}", "actor.model.builtin=null")
    with pytest.raises(ValueError, match=r"config key actor\.generation\.suppress_tokens got \[99\]; allowed: "
                                         r"token ids below the actor model's vocab_size = 24"):
        preflight(_config(tmp_path, *own, "actor.generation.suppress_tokens=[3, 99]"))
    with pytest.raises(ValueError, match=r"actor\.generation\.stop_token_ids got \[24\]"):
        preflight(_config(tmp_path, *own, "actor.generation.stop_token_ids=[24]"))


def test_a_causal_lm_given_as_the_reward_model_is_refused_a_trained_score_model_is_not(tmp_path, prompts):
    causal = _save_model(tmp_path / "causal")
    with pytest.raises(ValueError) as caught:
        preflight(_config(tmp_path, f"reward.model.path={causal}"))
    assert str(caught.value) == (
        f"config key reward.model.path: '{causal}' has no trained score head (no 'score.*' tensor; architectures "
        f"['LlamaForCausalLM']): its scores would come from a random head; give a model trained by `hybridflow rm`, "
        f"or reward.model_type=likelihood")
    preflight(_config(tmp_path, f"reward.model.path={causal}", "reward.model_type=likelihood"))
    preflight(_config(tmp_path, f"reward.model.path={_save_model(tmp_path / 'scorer', head='score')}"))


@pytest.mark.parametrize("exit_call, named", [("import sys\nsys.exit(3)", "sys.exit(3)"),
                                              ("import os\nos._exit(4)", "os._exit(4)")])
def test_a_reward_module_that_exits_at_import_is_reported_not_obeyed(tmp_path, prompts, exit_call, named):
    (tmp_path / "quitter.py").write_text(f"{exit_call}\ndef reward(prompt, response, **fields):\n    return 0.0\n")
    spec = f"{tmp_path / 'quitter.py'}:reward"
    with pytest.raises(ValueError) as caught:
        preflight(_config(tmp_path, f"reward.function={spec}"))
    assert str(caught.value) == (f"config key reward.function: reward function '{spec}': its module called {named} "
                                 f"while being imported; a reward module must not end the process")


def test_a_key_given_twice_in_yaml_is_refused_naming_both_lines(tmp_path, capsys):
    config = tmp_path / "twice.yaml"
    config.write_text("trainer:\n  total_steps: 5\n  seed: 1\n  total_steps: 50\n")
    with pytest.raises(ValueError) as caught:
        load_yaml(config)
    assert str(caught.value) == (f"config file {config}:4:3: YAML syntax error: key 'total_steps' is given twice in "
                                 f"one mapping (first at line 2); yaml would silently keep the last")
    assert main(["train", str(config)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_key_given_twice_in_a_json_row_is_refused_naming_the_file_and_line(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a"}\n{"prompt": "b", "answer": "1", "prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"dataset file '.*rows\.jsonl' line 2: key 'prompt' appears twice in one "
                                         r"object \(JSON would silently keep the last\)"):
        read_rows(rows)
    listed = tmp_path / "rows.json"
    listed.write_text('[{"prompt": "a", "prompt": "b"}]')
    with pytest.raises(ValueError, match=r"dataset file '.*rows\.json': key 'prompt' appears twice"):
        read_rows(listed)


def test_compressed_files_where_text_is_expected_are_named_as_compressed(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(gzip.compress(b'{"prompt": "a"}\n'))
    with pytest.raises(ValueError, match=r"dataset file '.*rows\.jsonl' is gzip-compressed, not \.jsonl text; "
                                         r"decompress it first \(gunzip\)"):
        read_rows(data)
    config = tmp_path / "run.yaml"
    config.write_bytes(gzip.compress(b"trainer: {}\n"))
    with pytest.raises(ValueError, match=r"config file '.*run\.yaml' is gzip-compressed; decompress it"):
        load_yaml(config)
    with pytest.raises(ValueError, match=r"config file '.*' is a directory; give a YAML file"):
        load_yaml(tmp_path)


def test_options_made_inert_by_the_rest_of_the_config_are_warned_about_naming_both_keys(tmp_path, prompts, capsys):
    ptx = write_jsonl(tmp_path / "ptx.jsonl", [{"prompt": "a", "response": "b"}])
    config = _config(tmp_path, "algorithm.kl_mode=none", "reference.model.builtin=arithmetic",
                     f"data.ptx_path={ptx}", "trainer.keep_last=2", "placement.pools={global: [2]}")
    assert inert_options(config) == [
        "reference.model is set but algorithm.kl_mode is 'none': no reference model is built",
        "data.ptx_path is set but actor.loss.ptx_coef is 0.0: the ptx rows are never read (set ptx_coef > 0 to train "
        "on them)",
        "trainer.keep_last is 2 but trainer.save_every is 0: no checkpoint is saved"]
    assert warn_local_pools(config) == [
        "placement.pools.global asks for 2 devices but --local runs every worker in this one process (world size 1)"]
    preflight(config)
    err = capsys.readouterr().err
    assert err.count("warning: ") == 4 and "--local runs every worker" in err


def test_a_reward_module_with_a_syntax_error_names_the_key_and_the_line(tmp_path, prompts):
    (tmp_path / "broken.py").write_text("def reward(prompt, response:\n    return 0\n")
    spec = f"{tmp_path / 'broken.py'}:reward"
    with pytest.raises(ValueError, match=r"config key reward\.function: reward function '.*broken\.py:reward': "
                                         r"importing it raised SyntaxError: '\(' was never closed "
                                         r"\(broken\.py, line 1\)"):
        preflight(_config(tmp_path, f"reward.function={spec}"))


def test_an_override_whose_value_is_not_yaml_names_the_override(tmp_path):
    with pytest.raises(ValueError) as caught:
        load_rl_config(None, ["placement.pools={global: [1}"])
    assert str(caught.value) == ("override 'placement.pools={global: [1}': its value is not valid YAML: expected ',' "
                                 "or ']', but got '}' (quote the value or fix its brackets)")
