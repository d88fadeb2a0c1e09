"""Our decoders against transformers greedy, run problem by problem side by side (each problem
decoded by every method, one after the other, in one process): the speed ratio the issue asks
for, with the machine's load the same for all.

    python docs/results/distill-cpu-2026-11-24/chunk-c2/side_by_side.py

Greedy here is the distilled model's own (same architecture, so the same cost per token as the
base model's). tokens/s is total tokens over total seconds; the median is over problems, of
greedy's seconds over the method's. Every method must return greedy's tokens (lossless).
"""

import statistics
from collections import Counter
from pathlib import Path

from python_training.evaluate import read_results

HERE = Path(__file__).parent
CAP = 256
RUNS = [  # label, files
    ("HumanEval[:82]", ["side-soup-he3-0-82.jsonl.gz"]),
    ("held-out packages[:48]", ["side-soup-heldout-0-48.jsonl.gz"]),
    ("HumanEval[:82], earlier run", ["side-soup-humaneval-0-82.jsonl.gz"]),
    ("HumanEval[:24], bf16", ["side-bf16-humaneval-0-24.jsonl.gz"]),
    ("HumanEval[:24], tuned calls racing AR with lookup", ["side-race-he3-0-24.jsonl.gz"]),
    (  # the runtime's CPU fast paths (packed bf16 linears, max targets), 2026-11-26 evening
        "HumanEval[:82], bf16, CPU fast paths",
        [f"../../cpu-fast-paths-2026-11-26/bf16-humaneval-{o}.jsonl.gz" for o in (0, 24)],
    ),
    (
        "held-out packages[:24], bf16, CPU fast paths",
        ["../../cpu-fast-paths-2026-11-26/bf16-code-heldout-0.jsonl.gz"],
    ),
]


def speed(rs) -> float:
    return sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)


def main() -> None:
    print(
        "| prompts | method | problems | greedy tok/s | tok/s | vs greedy | median per problem "
        "| TPF | answers that stop: vs greedy (count) | identical to greedy | settings |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, files in RUNS:
        rows = [r for f in files if (HERE / f).exists() for r in read_results(HERE / f)]
        g = {r["task_id"]: r for r in rows if r["method"] == "greedy"}
        for m in dict.fromkeys(r["method"] for r in rows if r["method"] != "greedy"):
            t = {r["task_id"]: r for r in rows if r["method"] == m}
            ids = sorted(set(g) & set(t))
            same = sum(g[i]["token_ids"] == t[i]["token_ids"] for i in ids)
            # fp32: every method returns greedy's tokens. bf16: a wide forward may round a
            # near-tie the other way than transformers' one-token forward (README, "bf16").
            if "bf16" not in label:
                assert same == len(ids), f"{label} {m}: not lossless"
            gs, ts = [g[i] for i in ids], [t[i] for i in ids]
            stop = [i for i in ids if g[i]["tokens"] < CAP]
            med = statistics.median(g[i]["seconds"] / t[i]["seconds"] for i in ids)
            tpf = sum(r["tokens"] for r in ts) / sum(r["forwards"] for r in ts)
            r_stop = speed([t[i] for i in stop]) / speed([g[i] for i in stop])
            used = Counter(r["settings"] for r in ts).most_common(2)
            print(f"| {label} | {m} | {len(ids)} | {speed(gs):.1f} | {speed(ts):.1f} | "
                  f"{speed(ts) / speed(gs):.2f}× | {med:.2f}× | {tpf:.2f} | {r_stop:.2f}× "
                  f"({len(stop)}) | {same}/{len(ids)} | "
                  f"{', '.join(f'{k} ×{n}' for k, n in used)} |")  # fmt: skip


if __name__ == "__main__":
    main()
