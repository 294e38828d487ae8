"""Exact match of a Hugging Face model's greedy answers on held-out prompts.

    python examples/reverse_task/evaluate.py runs/reverse/grpo/final/actor runs/reverse/val.jsonl
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def exact_match(model_dir: str, rows_path: str, *, max_new_tokens: int = 8) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in open(rows_path)]
    batch = tokenizer([row["prompt"] for row in rows], return_tensors="pt", padding=True)
    with torch.no_grad():
        output = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    answers = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(answer.strip() == row["answer"] for answer, row in zip(answers, rows)) / len(rows)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python examples/reverse_task/evaluate.py MODEL_DIR ROWS.jsonl")
    print(f"exact match: {exact_match(sys.argv[1], sys.argv[2]):.3f}")
