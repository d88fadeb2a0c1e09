"""Every distilled model evaluated on all 164 HumanEval problems, with the answers that loop apart.

tokens/s: each run on 1 thread beside one other job on this 2-core machine (as the base's greedy
reference, 14.0 tokens/s), so the speeds compare within this table only.

    python docs/results/distill-cpu-2026-11-24/chunk-c2/table.py

Tokens per forward summed over problems (the issue's figure) is dominated by answers that never
stop: a model that repeats a line until the 256-token cap commits many tokens a forward there
(4-6 for chunk B), so fewer loops read as a lower TPF. Each row therefore also gives
TPF over the answers that stopped before the cap, the median per problem, how many answers hit
the cap (the base model's greedy as the reference), and pass@1. A run on fewer than 164 problems
is followed by the base's and chunk B's rows on the same problems.
"""

import statistics
from pathlib import Path

from python_training.evaluate import read_results

HERE = Path(__file__).parent
RESULTS = HERE.parents[1]
CAP = 256
ALL3 = ["jacobi", "multiblock-nolookup", "multiblock-tuned"]
MODELS = [  # label, files, method rows to read
    ("base, transformers greedy", ["eval-cpu-2026-11-26/base-humaneval-164.jsonl"], ["greedy"]),
    ("base, tuned default", ["eval-cpu-2026-11-26/base-tuned-humaneval-164.jsonl.gz"],
     ["multiblock-tuned"]),
    ("chunk B (shipped until 2026-11-26 noon), 2.19 M tokens",
     ["eval-cpu-2026-11-26/smollm2-jf-humaneval-164-a.jsonl.gz",
      "eval-cpu-2026-11-26/smollm2-jf-humaneval-164-b.jsonl.gz"], ALL3),
    ("chunk C arm 4 (λ = 4, answer only), 2.55 M",
     ["fidelity-cpu-2026-11-26/chunk-c-ar4-answer-humaneval-164-jacobi.jsonl.gz"], ["jacobi"]),
    ("chunk C2 lr3 (λ = 1, answer only, lr 3e-4), 2.80 M",
     ["distill-cpu-2026-11-24/chunk-c2/lr3-humaneval-164.jsonl.gz"], ALL3[:2]),
    ("chunk C2 kl2 (+ KL to base μ = 2), 2.80 M",
     ["distill-cpu-2026-11-24/chunk-c2/kl2-humaneval-164.jsonl.gz"], ALL3),
    ("soup w0.5 = ½ lr3 + ½ kl2 (shipped)",
     ["distill-cpu-2026-11-24/chunk-c2/soup-humaneval-164.jsonl.gz"], ALL3[:2]),
    ("chunk D (from the soup, 1 000 unseen prompts, KL μ = 1), 3.16 M",
     ["distill-cpu-2026-11-24/chunk-d/chunk-d-humaneval-164.jsonl.gz"], ALL3[:2]),
    ("soup of chunk D and the shipped soup, ½ each",
     ["distill-cpu-2026-11-24/chunk-d/soup-d-humaneval-164.jsonl.gz"], ALL3[:1]),
    ("chunk E (from the soup, KL μ = 2, data order seed 1), 3.16 M",
     ["distill-cpu-2026-11-24/chunk-e/chunk-e-humaneval-164.jsonl.gz"], ALL3[:2]),
    ("chunk F (from the soup, KL μ = 1, finished answers only), 3.07 M",
     ["distill-cpu-2026-11-24/chunk-f/chunk-f-humaneval-164.jsonl.gz"], ALL3[:2]),
    ("chunk G (from F, its own Jacobi trajectories of 1 500 unseen prompts, ½ real states), 3.35 M",
     ["distill-cpu-2026-11-24/chunk-g/chunk-g-humaneval-164.jsonl.gz"], ALL3[:2]),
    ("chunk H (from G, its own Jacobi trajectories of the next 1 500 prompts), 3.61 M",
     ["distill-cpu-2026-11-24/chunk-h/chunk-h-humaneval-164.jsonl.gz"], ALL3[:2]),
    ("chunk I (from H, its own Jacobi trajectories of the next 1 500 prompts), 3.86 M",
     ["distill-cpu-2026-11-24/chunk-i/chunk-i-humaneval-164.jsonl.gz"], ALL3[:2]),
]  # fmt: skip


def rows_of(files, method) -> dict:
    out = {}
    for f in files:
        if (RESULTS / f).exists():
            out.update(
                {r["task_id"]: r for r in read_results(RESULTS / f) if r["method"] == method}
            )
    return out


def row(label: str, m: str, rows: list[dict], greedy: dict) -> str:
    stop = [r for r in rows if r["tokens"] < CAP]
    fw = [r for r in rows if r.get("forwards")]

    def tpf(rs):
        return sum(r["tokens"] for r in rs) / sum(r["forwards"] for r in rs)

    cells = (
        [f"{tpf(fw):.2f}", f"{tpf([r for r in stop if r.get('forwards')]):.2f}",
         f"{statistics.median(r['tokens'] / r['forwards'] for r in fw):.2f}"]
        if fw else ["-", "-", "-"]
    )  # fmt: skip
    passed = sum(bool(r["passed"]) for r in rows)
    tps = sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows)
    g = [greedy[r["task_id"]] for r in rows]
    vs = tps / (sum(r["tokens"] for r in g) / sum(r["seconds"] for r in g))
    cells += [f"{tps:.1f}", f"{vs:.2f}×"]
    cells += [str(len(rows) - len(stop)), f"{passed} ({100 * passed / len(rows):.1f} %)"]
    return f"| {label} | {m} | {len(rows)} | " + " | ".join(cells) + " |"


def main() -> None:
    print("| model | method | problems | TPF | TPF, answers that stop | median TPF per problem "
          "| tokens/s | vs base greedy | answers at the 256 cap | pass@1 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    base_label, base_files, _ = MODELS[0]
    chunk_b_label, chunk_b_files, _ = MODELS[2]
    greedy = rows_of(base_files, "greedy")
    for label, files, methods in MODELS:
        for m in methods:
            got = rows_of(files, m)
            if not got:
                continue
            print(row(label, m, list(got.values()), greedy))
            if len(got) < 164:  # a partial run: the references on the same problems
                for ref_label, ref_files, ref_m in ((base_label, base_files, "greedy"),
                                                    (chunk_b_label, chunk_b_files, m)):  # fmt: skip
                    ref = rows_of(ref_files, ref_m)
                    print(
                        row(f"↳ {ref_label}, same problems", ref_m, [ref[t] for t in got], greedy)
                    )


if __name__ == "__main__":
    main()
