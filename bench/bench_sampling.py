"""Decoding under sampling, side by side: what sampling costs the parallel methods and
whether context lookup still pays.

Per model (the base SmolLM2-135M-Instruct, and the shipped distilled adapter `smollm2-jf`) and
per temperature (top_p 0.9; greedy as the reference row), every method decodes the same HumanEval
prompts, interleaved prompt by prompt (A, B, C, A, B, C, ...: a shared machine's speed swings,
so the methods see the same load): transformers' `generate(do_sample=True)`, our `ar` sample,
`jacobi` n=16, `multiblock` n=16 with lookup off and on, and the default (tuned `multiblock`).
Rows: TPF, tokens/s (sum of tokens / sum of seconds, and the median per prompt), speed vs
transformers, and whether each method's output equals our `ar` sample token for token.

    OMP_NUM_THREADS=1 nice pytest bench/bench_sampling.py --benchmark-json=out/sampling.json
    JACOBI_BENCH_QUICK=1 pytest bench/bench_sampling.py           # tiny model, seconds
Env: JACOBI_BENCH_SAMPLING_MODELS (default "base,smollm2-jf"), JACOBI_BENCH_TEMPERATURES
(default "0.3,0.7,1.0"; 0 = greedy), JACOBI_BENCH_PROMPTS (8), JACOBI_BENCH_NEW_TOKENS (128).
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import pytest
import torch

from jacobi_ext import generate
from jacobi_ext.tools.baselines import hf_greedy, hf_sample

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import QUICK  # noqa: E402

TOP_P = 0.9
SEED = 0
METHODS = {  # name -> generate() keywords (None: transformers)
    "transformers": None,
    "ar": dict(method="ar"),
    "jacobi n=16": dict(method="jacobi", block_size=16),
    "multiblock n=16": dict(method="multiblock", block_size=16, lookup=False),
    "multiblock n=16 +lookup": dict(method="multiblock", block_size=16, lookup=True),
    "default (tuned)": dict(method="multiblock"),
}


def _env_list(name: str, default: str) -> list[str]:
    return [x.strip() for x in os.environ.get(name, default).split(",") if x.strip()]


MODELS = ["tiny"] if QUICK else _env_list("JACOBI_BENCH_SAMPLING_MODELS", "base,smollm2-jf")
TEMPS = [float(t) for t in _env_list("JACOBI_BENCH_TEMPERATURES", "0,0.3,0.7,1.0")]


def _load(name: str):
    if name == "tiny":
        from jacobi_ext.models import tiny_llama

        model = tiny_llama(vocab_size=128, seed=0)
        g = torch.Generator().manual_seed(0)
        return model, [torch.randint(0, 128, (1, 12), generator=g) for _ in range(2)], 16
    from jacobi_ext.data import humaneval_input_ids, load_humaneval
    from jacobi_ext.decoding.tuning import step_curve
    from jacobi_ext.models import load_model

    model, tok = load_model(None if name == "base" else name)
    n = int(os.environ.get("JACOBI_BENCH_PROMPTS", "8"))
    prompts = [humaneval_input_ids(tok, p) for p in load_humaneval(n)]
    step_curve(model)  # measured once and cached, before any timed run (the tuned default)
    return model, prompts, int(os.environ.get("JACOBI_BENCH_NEW_TOKENS", "128"))


def _one(model, ids, max_new: int, kw, temperature: float):
    """(tokens, seconds, forwards) of one method on one prompt."""
    sampled = temperature > 0
    if kw is None:
        if sampled:
            toks, dt = hf_sample(model, ids, max_new, SEED, temperature=temperature, top_p=TOP_P)
        else:
            toks, dt = hf_greedy(model, ids, max_new)
        return toks, dt, max(len(toks) - 1, 0)
    samp = dict(do_sample=True, temperature=temperature, top_p=TOP_P) if sampled else {}
    res = generate(model, ids, max_new_tokens=max_new, seed=SEED, **kw, **samp)
    return res.tokens[0].tolist(), res.seconds + res.prefill_seconds, res.forwards


def run_setting(model, prompts, max_new: int, temperature: float) -> dict:
    per = {m: {"tokens": [], "seconds": [], "forwards": [], "same": []} for m in METHODS}
    for ids in prompts:  # interleaved: every method on this prompt, then the next prompt
        ref = None
        for name, kw in METHODS.items():
            toks, dt, fw = _one(model, ids, max_new, kw, temperature)
            if name == "ar":
                ref = toks
            r = per[name]
            r["tokens"].append(len(toks))
            r["seconds"].append(dt)
            r["forwards"].append(fw)
            r["same"].append(None if ref is None else toks == ref)
    rows = {}
    hf_tps = sum(per["transformers"]["tokens"]) / sum(per["transformers"]["seconds"])
    for name, r in per.items():
        tok, sec, fw = sum(r["tokens"]), sum(r["seconds"]), sum(r["forwards"])
        same = [s for s in r["same"] if s is not None]
        rows[name] = {
            "tokens": tok,
            "forwards": fw,
            "seconds": sec,
            "tpf": tok / max(fw, 1),
            "tokens_per_s": tok / sec,
            "median_tokens_per_s": statistics.median(
                t / s for t, s in zip(r["tokens"], r["seconds"], strict=True)
            ),
            "vs_transformers": tok / sec / hf_tps,
            "identical_to_ar": all(same) if same else None,
        }
    return rows


@pytest.mark.parametrize("model_name", MODELS)
def test_sampling(benchmark, model_name: str) -> None:
    model, prompts, max_new = _load(model_name)
    out = {}

    def run():
        for t in TEMPS:
            out[f"T={t:g}"] = run_setting(model, prompts, max_new, t)

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(
        model=model_name, prompts=len(prompts), max_new_tokens=max_new, top_p=TOP_P, seed=SEED,
        threads=torch.get_num_threads(), settings=out,
    )  # fmt: skip
    for setting, rows in out.items():
        for name, r in rows.items():
            if name != "transformers":  # our methods: always our AR sample (greedy: AR greedy)
                assert r["identical_to_ar"] in (True, None), (setting, name)


def render(paths: list[Path]) -> str:
    """The Markdown tables of sampling JSON files (python bench/bench_sampling.py FILE...)."""
    import json

    out = []
    for path in paths:
        for b in json.loads(Path(path).read_text())["benchmarks"]:
            e = b["extra_info"]
            out += [
                f"### {e['model']}: {e['prompts']} HumanEval prompts x {e['max_new_tokens']} "
                f"new tokens, top_p {e['top_p']}, seed {e['seed']}, {e['threads']} thread(s)",
                "",
                "| setting | method | TPF | tokens/s | median tokens/s per prompt "
                "| vs transformers | identical to our AR |",
                "|---|---|---|---|---|---|---|",
            ]
            for setting, rows in e["settings"].items():
                label = "greedy" if setting == "T=0" else setting
                for name, r in rows.items():
                    same = {True: "yes", False: "NO", None: "-"}[r["identical_to_ar"]]
                    out.append(
                        f"| {label} | {name} | {r['tpf']:.2f} | {r['tokens_per_s']:.1f} "
                        f"| {r['median_tokens_per_s']:.1f} | {r['vs_transformers']:.2f}x | {same} |"
                    )
            out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render([Path(p) for p in sys.argv[1:]]))
