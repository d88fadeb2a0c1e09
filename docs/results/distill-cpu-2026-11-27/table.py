"""Issue 39's measures for each adapter, HumanEval (164) and the held-out packages (48).

Judged, in this order: (1) tokens per forward over the answers that stop before the 256-token
cap, plain `jacobi` and `multiblock` without lookup; (2) answers that loop to the cap (the base
model's greedy: 43 on HumanEval); (3) pass@1 (HumanEval only: the held-out prompts have no
tests). TPF over every answer is printed beside them. "identical" counts the problems whose
`jacobi` and `multiblock` token ids are equal (both are lossless against the model's greedy by
construction and by the tests; a difference here would be a bug).

    python docs/results/distill-cpu-2026-11-27/table.py
"""

from pathlib import Path

from python_training.evaluate import read_results

HERE = Path(__file__).parent
RESULTS = HERE.parent
CAP = 256
BASE = {  # the base model's greedy rows (transformers', fp32, 256 tokens)
    "humaneval": "eval-cpu-2026-11-26/base-humaneval-164.jsonl",
    "heldout": "eval-cpu-2026-11-26/base-heldout-48.jsonl.gz",
}


def here(stem: str, splits: tuple[str, ...] = ("humaneval", "heldout")) -> dict:
    """This folder's eval rows of one model: {split: [file]}."""
    n = {"humaneval": 164, "heldout": 48}
    return {s: [f"distill-cpu-2026-11-27/{stem}-{s}-{n[s]}.jsonl.gz"] for s in splits}


MODELS = [  # label, {split: result files}
    ("chunk H (shipped)", {
        "humaneval": ["distill-cpu-2026-11-24/chunk-h/chunk-h-humaneval-164.jsonl.gz"],
        "heldout": ["distill-cpu-2026-11-27/chunk-h-heldout-48.jsonl.gz"]}),
    ("chunk I (from H, H's trajectories at 128 tokens)", {
        "humaneval": ["distill-cpu-2026-11-24/chunk-i/chunk-i-humaneval-164.jsonl.gz"]}),
    ("chunk I2 (chunk I's recipe again: J's data cut to the answers that end within 128)",
     here("chunk-i2")),
    ("chunk J (from H, H's trajectories at 256 tokens)", here("chunk-j")),
    ("chunk K (I2's data and steps, KL to the base μ = 3)", here("chunk-k")),
    ("chunk L (n = 32 curriculum: H's trajectories at n = 32, new prompts, window 32)",
     here("chunk-l")),
    ("chunk L2 (chunk L again, seed 5)", here("chunk-l2")),
    ("½ I2 + ½ J (a weight-space soup, cut to rank 16)", here("soup-i2-j")),
]  # fmt: skip


N32 = [  # the same measures with n = 32 (HumanEval only): L was trained at window 32
    ("chunk H (shipped), n = 32", here("chunk-h-n32", ("humaneval",))),
    ("chunk L, n = 32", here("chunk-l-n32", ("humaneval",))),
]


def rows_of(files: list[str], method: str) -> dict:
    out = {}
    for f in files:
        if (RESULTS / f).exists():
            rows = read_results(RESULTS / f)
            out.update({r["task_id"]: r for r in rows if r["method"] == method})
    return out


def tpf(rows) -> str:
    f = sum(r["forwards"] for r in rows)
    return f"{sum(r['tokens'] for r in rows) / f:.2f}" if f else "-"


def main() -> None:
    tables = [("humaneval", 164, 16, MODELS), ("heldout", 48, 16, MODELS)]
    tables.append(("humaneval", 164, 32, N32))
    for split, n_tasks, n, models in tables:
        base = rows_of([BASE[split]], "greedy")
        print(f"\n{split}: {n_tasks} prompts, fp32, greedy, n = {n}, {CAP} new tokens\n")
        print("| model | jacobi TPF, answers that stop | multiblock no lookup, answers that stop "
              "| answers at the cap | pass@1 | jacobi TPF, all | multiblock, all "
              "| jacobi = multiblock |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        b = list(base.values())
        loops = sum(r["tokens"] >= CAP for r in b)
        passed = sum(bool(r["passed"]) for r in b) if split == "humaneval" else "-"
        print(f"| base (transformers greedy) | 1.00 | - | {loops} | {passed} | 1.00 | - | - |")
        for label, files in models:
            if split not in files:
                continue
            j, m = rows_of(files[split], "jacobi"), rows_of(files[split], "multiblock-nolookup")
            if len(j) < n_tasks or len(m) < n_tasks:
                print(f"| {label} | ({len(j)}/{len(m)} of {n_tasks} measured) |||||||")
                continue
            js, ms = list(j.values()), list(m.values())
            stop_j = [r for r in js if r["tokens"] < CAP]
            stop_m = [r for r in ms if r["tokens"] < CAP]
            same = sum(j[t]["token_ids"] == m[t]["token_ids"] for t in j)
            passed = sum(bool(r["passed"]) for r in js) if split == "humaneval" else "-"
            print(f"| {label} | {tpf(stop_j)} | {tpf(stop_m)} | {len(js) - len(stop_j)} | "
                  f"{passed} | {tpf(js)} | {tpf(ms)} | {same}/{len(js)} |")  # fmt: skip


if __name__ == "__main__":
    main()
