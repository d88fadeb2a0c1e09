"""The README's base-vs-distilled table from this folder's `jacobi-forcing eval` result files.

    python docs/results/eval-cpu-2026-11-25/table.py

Per model, prompt set and method: TPF (tokens / forwards, summed over problems), tokens/s
(tokens / seconds, summed), speed against the *base* model's transformers greedy on the same
problems (the issue's reference, not the distilled model's own greedy), and whether every
answer is token for token the model's own greedy answer. The figures per file come from
`jacobi-forcing eval`'s own summary (`python_training.evaluate.summarize`).
"""

from pathlib import Path

from python_training.evaluate import summarize

HERE = Path(__file__).parent
MODELS = {"base": "base", "smollm2-jf": "distilled (`smollm2-jf`)"}
SETS = {"humaneval": "HumanEval[:16]", "code-heldout": "held-out packages[:16]"}
METHODS = {
    "greedy": "transformers greedy",
    "jacobi": "`jacobi` n=16",
    "multiblock-nolookup": "`multiblock` n=16, no lookup",
    "multiblock-tuned": "`multiblock` tuned (the default; lookup on)",
}


def main() -> None:
    print(
        "| prompts | model | method | TPF | tokens/s | vs base greedy | identical to own greedy |"
    )
    print("|---|---|---|---|---|---|---|")
    for prompts, set_name in SETS.items():
        base_tps = summarize(HERE / f"base-{prompts}.jsonl")["greedy"]["tokens_per_s"]
        for model, model_name in MODELS.items():
            summary = summarize(HERE / f"{model}-{prompts}.jsonl")
            for method, method_name in METHODS.items():
                s = summary[method]
                same = "yes" if s["identical"] == 1.0 else f"NO ({s['identical']:.0%})"
                print(
                    f"| {set_name} | {model_name} | {method_name} | {s['tpf']:.2f} | "
                    f"{s['tokens_per_s']:.1f} | {s['tokens_per_s'] / base_tps:.2f}x | "
                    f"{same} ({s['tasks']}) |"
                )


if __name__ == "__main__":
    main()
