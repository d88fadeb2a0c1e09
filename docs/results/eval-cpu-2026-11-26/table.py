"""The README's tables for issue 19's targets from this folder's result files.

    python docs/results/eval-cpu-2026-11-26/table.py

HumanEval, all 164 problems: base-humaneval-164.jsonl is the base model's transformers greedy
(the reference of the issue's targets: tokens/s and pass@1); base-tuned-humaneval-164.jsonl.gz the
base model's tuned default (`multiblock-tuned`), so that what the distillation adds to the tuned
decoder is visible apart from what lookup drafts give any model; smollm2-jf-humaneval-164*.jsonl
the shipped distilled model's parallel methods (one file per slice of problems, run side by side
on the two cores).

Held-out packages (the first 48 prompts of the split training never saw, no tests so no pass@1):
base-heldout-48.jsonl.gz (greedy and tuned), smollm2-jf-heldout-48.jsonl.gz.

Per method: TPF (tokens / forwards), tokens/s (tokens / seconds), both summed over problems; speed
against the base model's greedy on the same problems; what the tuner picked; pass@1; and whether
the distilled model's parallel methods agree token for token with each other (each claims the
distilled model's own greedy answer).
"""

import collections
import json
from pathlib import Path

from python_training.evaluate import read_results, summarize_rows

HERE = Path(__file__).parent
METHODS = {
    "jacobi": "`jacobi` n=16",
    "multiblock-nolookup": "`multiblock` n=16, no lookup",
    "multiblock-tuned": "`multiblock` tuned (the default; lookup on)",
}


def _rows(files):
    rows = []
    for f in files:
        if f.exists():
            rows += read_results(f)  # .jsonl or .jsonl.gz
    return rows


def _picked(rows, method) -> str:
    """What the tuner ran for ``method`` (e.g. "ar+lookup" on 164/164), or "" for fixed ones."""
    if not method.endswith("-tuned"):
        return ""
    c = collections.Counter(r["settings"].split(" ")[0] for r in rows if r["method"] == method)
    return " → " + ", ".join(f"{k} ({v})" for k, v in c.most_common())


def table(title: str, base_rows: list, dist_rows: list, pass_at_1: bool) -> None:
    # Every model on exactly the problems the distilled runs have done (all of them once they
    # finish; a resumed run's partial files compare like with like).
    done = {r["task_id"] for r in dist_rows}
    base_rows = [r for r in base_rows if r["task_id"] in done]
    base, dist = summarize_rows(base_rows), summarize_rows(dist_rows)
    greedy_tps = base["greedy"]["tokens_per_s"]
    print(f"\n{title}\n")
    print("| model | method | problems | TPF | tokens/s | vs base greedy |"
          + (" pass@1 |" if pass_at_1 else ""))  # fmt: skip
    print("|---|---|---|---|---|---|" + ("---|" if pass_at_1 else ""))
    lines = [("base", "transformers greedy", "greedy", base, base_rows)]
    if "multiblock-tuned" in base:
        lines.append(("base", METHODS["multiblock-tuned"], "multiblock-tuned", base, base_rows))
    lines += [("distilled (`smollm2-jf`)", name, m, dist, dist_rows) for m, name in METHODS.items()]
    for model, name, m, s, rows in lines:
        if m not in s:
            continue
        r = s[m]
        p = f" {100 * r['pass@1']:.1f} % |" if pass_at_1 else ""
        print(
            f"| {model} | {name}{_picked(rows, m)} | {r['tasks']} | {r['tpf']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / greedy_tps:.2f}x |{p}"
        )
    ids: dict[str, dict[str, list]] = {}
    for r in dist_rows:
        ids.setdefault(r["task_id"], {})[r["method"]] = r.get("token_ids")
    n_methods = len({r["method"] for r in dist_rows})
    both = [t for t, d in ids.items() if len(d) == n_methods]
    agree = sum(len({json.dumps(v) for v in ids[t].values()}) == 1 for t in both)
    print(f"\ndistilled model's methods token-identical to each other on {agree}/{len(both)}")


def main() -> None:
    table(
        "HumanEval, all 164 problems",
        _rows([HERE / "base-humaneval-164.jsonl", HERE / "base-tuned-humaneval-164.jsonl.gz"]),
        _rows(sorted(HERE.glob("smollm2-jf-humaneval-164*.jsonl*"))),
        pass_at_1=True,
    )
    table(
        "Held-out packages, the first 48 prompts",
        _rows([HERE / "base-heldout-48.jsonl.gz"]),
        _rows([HERE / "smollm2-jf-heldout-48.jsonl.gz"]),
        pass_at_1=False,
    )


if __name__ == "__main__":
    main()
