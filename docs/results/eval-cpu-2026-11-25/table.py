"""The README's base-vs-distilled table from this folder's `jacobi-forcing eval` result files.

    python docs/results/eval-cpu-2026-11-25/table.py

Per model, prompt set and method: TPF (tokens / forwards, summed over problems), tokens/s
(tokens / seconds, summed), speed against the *base* model's transformers greedy on the same
problems (the issue's reference, not the distilled model's own greedy), and whether every
answer is token for token the model's own greedy answer.
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
MODELS = {"base": "base", "smollm2-jf": "distilled (`smollm2-jf`)"}
SETS = {"humaneval": "HumanEval[:16]", "code-heldout": "held-out packages[:16]"}
METHODS = {
    "greedy": "transformers greedy",
    "jacobi": "`jacobi` n=16",
    "multiblock-nolookup": "`multiblock` n=16, no lookup",
    "multiblock-tuned": "`multiblock` tuned (the default; lookup on)",
}


def load(model: str, prompts: str) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {}
    for line in (HERE / f"{model}-{prompts}.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows.setdefault(r["method"], []).append(r)
    return rows


def main() -> None:
    print(
        "| prompts | model | method | TPF | tokens/s | vs base greedy | identical to own greedy |"
    )
    print("|---|---|---|---|---|---|---|")
    for prompts, set_name in SETS.items():
        base = load("base", prompts)["greedy"]
        base_tps = sum(r["tokens"] for r in base) / sum(r["seconds"] for r in base)
        for model, model_name in MODELS.items():
            rows = load(model, prompts)
            own = {r["task_id"]: r["token_ids"] for r in rows["greedy"]}
            for method, method_name in METHODS.items():
                rs = rows[method]
                tok = sum(r["tokens"] for r in rs)
                tpf = tok / sum(r["forwards"] for r in rs)
                tps = tok / sum(r["seconds"] for r in rs)
                same = all(own[r["task_id"]] == r["token_ids"] for r in rs)
                print(
                    f"| {set_name} | {model_name} | {method_name} | {tpf:.2f} | {tps:.1f} | "
                    f"{tps / base_tps:.2f}x | {'yes' if same else 'NO'} ({len(rs)}) |"
                )


if __name__ == "__main__":
    main()
