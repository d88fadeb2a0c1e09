"""The fidelity table of this folder's README from its JSON files.

    python docs/results/fidelity-cpu-2026-11-26/table.py

Each JSON is the output of `jacobi-forcing fidelity --out` for one model against the base model's
fp32 greedy answers to all 164 HumanEval problems (256 tokens,
docs/results/eval-cpu-2026-11-26/base-humaneval-164.jsonl).
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
ROWS = [  # file, what it is, packed training tokens behind it, AR setting
    ("base-bf16", "base model in bf16 (the collection's dtype)", "0", "-"),
    ("step-1800", "step 1800 of the scale run", "0.64 M", "λ = 1, prompt + answer"),
    ("step-2300-anneal", "step 2000 + 300-step anneal", "0.82 M", "λ = 1, prompt + answer"),
    ("chunk-a", "chunk A", "1.36 M", "λ = 1, prompt + answer"),
    (
        "chunk-b-shipped",
        "chunk B (shipped until 2026-11-26 noon)",
        "2.19 M",
        "λ = 1, prompt + answer",
    ),
    ("chunk-c-ar1-control", "chunk C control (from chunk B)", "2.55 M", "λ = 1, prompt + answer"),
    ("chunk-c-ar1-answer", "chunk C arm 1 (from chunk B)", "2.55 M", "λ = 1, answer only"),
    ("chunk-c-ar4-answer", "chunk C arm 4 (from chunk B)", "2.55 M", "λ = 4, answer only"),
    ("chunk-c2-lr3", "chunk C2 lr3 (from chunk B, lr 3e-4)", "2.80 M", "λ = 1, answer only"),
    (
        "chunk-c2-kl2",
        "chunk C2 kl2 (from chunk B, lr 3e-4)",
        "2.80 M",
        "λ = 1, answer only, + KL to base μ = 2",
    ),
    (
        "soup-w0.5",
        "½ lr3 + ½ kl2 (chunk-c2/soup_adapters.py; **shipped**)",
        "2.80 M",
        "the mean of the two",
    ),
    # Chunk B's adapter at another strength (scale_adapter.py: LoRA B times s).
    ("scale-0.5", "chunk B at strength 0.5", "2.19 M", "λ = 1, prompt + answer"),
    ("scale-0.75", "chunk B at strength 0.75", "2.19 M", "λ = 1, prompt + answer"),
    ("scale-1.25", "chunk B at strength 1.25", "2.19 M", "λ = 1, prompt + answer"),
]


def main() -> None:
    print("| model | packed tokens | AR term | top-1 agreement | NLL | median shared prefix "
          "| identical answers |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, what, tokens, ar in ROWS:
        s = json.loads((HERE / f"{name}.json").read_text())["summary"]
        print(
            f"| {what} | {tokens} | {ar} | {s['agreement']:.3f} | {s['nll']:.3f} | "
            f"{s['median_prefix']:g} tokens | {100 * s['identical']:.0f} % |"
        )


if __name__ == "__main__":
    main()
