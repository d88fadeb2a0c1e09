"""How close a distilled model stays to its base model: the base's greedy answers, teacher-forced.

Jacobi Forcing trades some of the base model's behaviour for parallel-decoding speed. pass@1 on
HumanEval measures the cost, but coarsely (a 135M model passes ~10 of 164 problems, so one flip
is 0.6 points) and slowly (every answer decoded and executed). This measures it densely and in
one forward per problem: the base model's greedy answer (a ``greedy`` row of an ``eval``
results file, ``token_ids`` included) is fed to the model after its prompt, and at every answer
position we read

- ``agreement``: whether the model's top-1 token is the base's next token;
- ``nll``: the model's negative log-likelihood of the base's next token;
- ``prefix``: the first position where they disagree. This is exactly how many tokens the
  model's own greedy answer shares with the base's (greedy continues the same prefix until its
  argmax first differs), so ``identical`` = prefix equals the whole answer.

The base model scores agreement 1.0 on its own rows, up to the float ties between dtypes of
the run that wrote them and this one (compare a model with the base in the same dtype).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch
import torch.nn.functional as F


def reference_rows(results: str | Path, method: str = "greedy") -> list[dict]:
    """The rows of ``method`` (default the base's transformers greedy) in an eval results file,
    each with its ``task_id`` and ``token_ids``."""
    from .evaluate import read_results

    out = [r for r in read_results(results) if r.get("method") == method and "token_ids" in r]
    if not out:
        raise ValueError(
            f"{results} has no {method!r} rows with token_ids: write them first with "
            f"`jacobi-forcing eval --methods {method} --results {results}` on the base model"
        )
    return out


@torch.inference_mode()
def score_answer(model, prompt_ids: torch.Tensor, answer: list[int]) -> dict:
    """Teacher-force ``answer`` after ``prompt_ids`` ([1, P]) and score each answer position."""
    if not answer:
        return {"tokens": 0, "agreement": None, "nll": None, "prefix": 0, "identical": True}
    device = next(model.parameters()).device
    ans = torch.tensor(answer, dtype=torch.long, device=device)
    ids = torch.cat([prompt_ids.to(device)[0], ans])[None]
    P = prompt_ids.shape[-1]
    # The logit at P-1+t predicts answer token t.
    logits = model(input_ids=ids, use_cache=False).logits[0, P - 1 : P - 1 + len(answer)].double()
    hit = logits.argmax(-1) == ans
    nll = F.cross_entropy(logits, ans, reduction="none")
    miss = (~hit).nonzero()
    prefix = int(miss[0, 0]) if miss.numel() else len(answer)
    return {
        "tokens": len(answer),
        "agreement": float(hit.float().mean()),
        "nll": float(nll.mean()),
        "prefix": prefix,
        "identical": prefix == len(answer),
    }


def fidelity(model, tokenizer, rows: list[dict], prompts: str = "humaneval",
             progress: bool = True) -> dict:  # fmt: skip
    """Per task and in aggregate: how the model scores the base's answers in ``rows``.

    Aggregates: ``agreement`` and ``nll`` are token-weighted means over all answer tokens;
    ``median_prefix`` and ``identical`` (a fraction of the tasks) are per task."""
    from tqdm.auto import tqdm

    from .evaluate import _problems

    by_id = {p["task_id"]: p for p in _problems(prompts, tokenizer)}
    unknown = [r["task_id"] for r in rows if r["task_id"] not in by_id]
    if unknown:
        raise ValueError(
            f"{len(unknown)} reference task(s) are not in the {prompts!r} prompts "
            f"(e.g. {unknown[0]!r}): pass the prompt set the reference rows were decoded on"
        )
    per = {}
    for r in tqdm(rows, desc="fidelity", unit="task", disable=not progress):
        per[r["task_id"]] = score_answer(model, by_id[r["task_id"]]["input_ids"], r["token_ids"])
    scored = [s for s in per.values() if s["tokens"]]
    n_tok = sum(s["tokens"] for s in scored)
    summary = {
        "tasks": len(per),
        "tokens": n_tok,
        "agreement": sum(s["agreement"] * s["tokens"] for s in scored) / n_tok if n_tok else None,
        "nll": sum(s["nll"] * s["tokens"] for s in scored) / n_tok if n_tok else None,
        "median_prefix": statistics.median(s["prefix"] for s in per.values()) if per else None,
        "identical": sum(s["identical"] for s in per.values()) / len(per) if per else None,
    }
    return {"summary": summary, "tasks": per}
