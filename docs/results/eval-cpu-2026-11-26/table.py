"""The README's all-164-HumanEval table (issue 19's targets) from this folder's result files.

    python docs/results/eval-cpu-2026-11-26/table.py

base-humaneval-164.jsonl: the base model's transformers greedy (the reference of the issue's
targets: tokens/s and pass@1). smollm2-jf-humaneval-164*.jsonl: the shipped distilled model's
parallel methods (one file per slice of problems, run side by side on the two cores). Per
method: TPF (tokens / forwards), tokens/s (tokens / seconds), both summed over problems; speed
against the base model's greedy; pass@1; and whether the parallel methods agree token for token
with each other (each claims the distilled model's own greedy answer).
"""

import json
from pathlib import Path

from python_training.evaluate import summarize_rows

HERE = Path(__file__).parent
METHODS = {
    "jacobi": "`jacobi` n=16",
    "multiblock-nolookup": "`multiblock` n=16, no lookup",
    "multiblock-tuned": "`multiblock` tuned (the default; lookup on)",
}


def _rows(files):
    rows = []
    for f in files:
        rows += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return rows


def main() -> None:
    rows = _rows(sorted(HERE.glob("smollm2-jf-humaneval-164*.jsonl")))
    # The base model on exactly the problems the distilled runs have done (all 164 once they
    # finish; a resumed run's partial files compare like with like).
    done = {r["task_id"] for r in rows}
    base_rows = [r for r in _rows([HERE / "base-humaneval-164.jsonl"]) if r["task_id"] in done]
    base = summarize_rows(base_rows)["greedy"]
    dist = summarize_rows(rows)
    print("| model | method | problems | TPF | tokens/s | vs base greedy | pass@1 |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| base | transformers greedy | {base['tasks']} | 1.00 | {base['tokens_per_s']:.1f} | "
        f"1.00x | {100 * base['pass@1']:.1f} % |"
    )
    for m, name in METHODS.items():
        if m not in dist:
            continue
        s = dist[m]
        print(
            f"| distilled (`smollm2-jf`) | {name} | {s['tasks']} | {s['tpf']:.2f} | "
            f"{s['tokens_per_s']:.1f} | {s['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{100 * s['pass@1']:.1f} % |"
        )
    ids: dict[str, dict[str, list]] = {}
    for r in rows:
        ids.setdefault(r["task_id"], {})[r["method"]] = r.get("token_ids")
    both = [t for t, d in ids.items() if len(d) == len(METHODS)]
    agree = sum(len({json.dumps(v) for v in ids[t].values()}) == 1 for t in both)
    print(f"\nparallel methods token-identical to each other on {agree}/{len(both)} problems")


if __name__ == "__main__":
    main()
