"""How far context-lookup drafts alone can go on the benchmark's prompts: each rule replayed against
the known greedy answers (vLLM ar's token lists in a round's JSON), a step accepting the drafts'
longest prefix that matches the answer plus one token, as a greedy verifier does. Tokens per
forward (the prefill counted as one, as bench/vllm_cpu.py counts it), steps, steps that drafted.

    cd docs/results/vllm-cpu-2026-12-08
    python lookup_ceiling.py prompts.json round8-k3-cost-aware.json > lookup_ceiling.md

Rules: vLLM's `ngram` (the longest suffix of 4 down to 2 tokens that occurred before, its first
occurrence, k tokens after it: replayed at k = 4 it gives 1.524 tokens per forward, vLLM's own
count 1.52) and our NgramIndex (jacobi_ext/decoding/lookup.py: the longest suffix of max_n down
to 1 tokens, its most recent occurrence; the proposer's and the engine's lookup), at a few
draft counts.
"""

import json
import sys

from jacobi_ext.decoding.lookup import NgramIndex


def replay(prompts, answers, rule) -> tuple[float, int, int]:
    steps = drafting = tokens = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        ctx, i = [*prompt, answer[0]], 1  # the prefill's step gives the first token
        steps += 1
        while i < len(answer):
            draft = rule(ctx)
            a = 0
            while a < len(draft) and i + a < len(answer) and draft[a] == answer[i + a]:
                a += 1
            n = min(a + 1, len(answer) - i)
            ctx += answer[i : i + n]
            i += n
            steps += 1
            drafting += bool(draft)
        tokens += len(answer)
    return tokens / steps, steps, drafting


def vllm_ngram(k: int, n_min: int = 2, n_max: int = 4):
    def rule(ctx):
        for n in range(n_max, n_min - 1, -1):
            suffix = ctx[-n:]
            for j in range(len(ctx) - n):
                if ctx[j : j + n] == suffix:
                    return ctx[j + n : j + n + k]
        return []

    return rule


def ngram_index(k: int, min_match: int = 1, max_n: int = 3):
    def rule(ctx):
        index = NgramIndex(ctx, max_n)
        g, j = index.match()
        return index.continuation(j, k) if g >= min_match else []

    return rule


def main() -> None:
    prompts = json.loads(open(sys.argv[1]).read())["ids"]
    answers = json.loads(open(sys.argv[2]).read())["results"]["ar"]["batch1"]["tokens"]
    rules = {
        "vLLM ngram, k = 4 (as benchmarked)": vllm_ngram(4),
        "vLLM ngram, k = 7": vllm_ngram(7),
        "NgramIndex, match >= 1, k = 3 (the proposer's lookup at 3 drafts)": ngram_index(3),
        "NgramIndex, match >= 2, k = 3": ngram_index(3, 2),
        "NgramIndex, match >= 1 of up to 4, k = 4": ngram_index(4, 1, 4),
        "NgramIndex, match >= 1 of up to 4, k = 7": ngram_index(7, 1, 4),
    }
    print("| rule | tokens per forward | steps | steps with drafts |")
    print("|---|---|---|---|")
    for name, rule in rules.items():
        tpf, steps, drafting = replay(prompts, answers, rule)
        print(f"| {name} | {tpf:.3f} | {steps} | {drafting} |")


if __name__ == "__main__":
    main()
