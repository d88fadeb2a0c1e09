"""Where a distilled model first leaves the base's greedy answer, how sure was the base?

    python docs/results/fidelity-cpu-2026-11-26/margins.py [fidelity JSON ...]   # ~2 min, 1 thread

For every HumanEval problem, the base model (fp32) is run once over its own greedy answer
(docs/results/eval-cpu-2026-11-26/base-humaneval-164.jsonl) and reads, at each answer token, the
margin between its top-1 and top-2 probabilities. Each fidelity JSON gives the position where that
model's top-1 first differs from the base's token (its ``prefix``). The printout compares the
base's margins there with its margins over all answer tokens: if the first disagreements sit at
the base's close calls, any small change of the weights flips them, and what follows is a
different answer, right or wrong.
"""

import json
import statistics
import sys
from pathlib import Path

import torch

from jacobi_ext.models import load_model
from python_training.evaluate import _problems, read_results

HERE = Path(__file__).parent
REFERENCE = HERE.parent / "eval-cpu-2026-11-26" / "base-humaneval-164.jsonl"
CLOSE = 0.2  # a "close call": top-1 minus top-2 probability below this


def base_margins(model, tok) -> dict[str, list[float]]:
    rows = [r for r in read_results(REFERENCE) if r["method"] == "greedy"]
    by_id = {p["task_id"]: p for p in _problems("humaneval", tok)}
    out = {}
    for r in rows:
        prompt, answer = by_id[r["task_id"]]["input_ids"], r["token_ids"]
        ids = torch.cat([prompt[0], torch.tensor(answer)])[None]
        P = prompt.shape[-1]
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=False).logits[0, P - 1 : P - 1 + len(answer)]
        top2 = logits.double().softmax(-1).topk(2, -1).values
        out[r["task_id"]] = (top2[:, 0] - top2[:, 1]).tolist()
    return out


def main(paths: list[str]) -> None:
    torch.set_num_threads(1)
    model, tok = load_model(None, dtype=torch.float32)
    margins = base_margins(model, tok)
    every = [m for ms in margins.values() for m in ms]
    print("| where | tokens | base's median top-1 − top-2 margin | share of close calls (< 0.2) |")
    print("|---|---|---|---|")
    print(f"| every answer token | {len(every)} | {statistics.median(every):.2f} | "
          f"{sum(m < CLOSE for m in every) / len(every):.2f} |")  # fmt: skip
    for path in paths or sorted(str(p) for p in HERE.glob("*.json")):
        tasks = json.loads(Path(path).read_text())["tasks"]
        first = [margins[t][s["prefix"]] for t, s in tasks.items() if s["prefix"] < len(margins[t])]
        close = sum(m < CLOSE for m in first) / len(first)
        print(f"| first disagreement, {Path(path).stem} | {len(first)} | "
              f"{statistics.median(first):.2f} | {close:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
