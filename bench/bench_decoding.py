"""Decoding speed, side by side in one run (issue: decoding engine).

SmolLM2-135M-Instruct, fp32, CPU, 20 HumanEval prompts, 256 new tokens, greedy, batch 1:
transformers greedy, transformers prompt-lookup decoding, and ours: ar, jacobi, multiblock.
Each benchmark decodes all prompts once (one round; the prompts are the repetitions); the
tokens/s, TPF, speedup over transformers greedy and whether outputs are identical to greedy go
into extra_info.

    pytest bench/bench_decoding.py --benchmark-json=out/decoding.json
    JACOBI_BENCH_QUICK=1 pytest bench/bench_decoding.py     # tiny model, seconds
"""

from __future__ import annotations

import pytest
import torch

from jacobi_ext import generate
from jacobi_ext.decoding.baselines import hf_greedy

_greedy: dict[str, object] = {}


def _run(method, model, prompts, max_new):
    outs, secs, forwards = [], 0.0, 0
    for ids in prompts:
        if method == "hf-greedy":
            toks, dt = hf_greedy(model, ids, max_new)
            secs += dt
            forwards += len(toks) - 1
        elif method == "hf-prompt-lookup":
            toks, dt = hf_greedy(model, ids, max_new, prompt_lookup_num_tokens=10)
            secs += dt
            forwards += 0  # not reported by transformers
        else:
            kw = {
                "ar": dict(method="ar"),
                "jacobi": dict(method="jacobi", block_size=16),
                "jacobi-tuned": dict(method="jacobi"),
                "multiblock": dict(method="multiblock"),
            }[method]
            res = generate(model, ids, max_new_tokens=max_new, **kw)
            toks = res.tokens[0].tolist()
            secs += res.seconds + res.prefill_seconds
            forwards += res.forwards
        outs.append(toks)
    return outs, secs, forwards


METHODS = ["hf-greedy", "hf-prompt-lookup", "ar", "jacobi", "jacobi-tuned", "multiblock"]


@pytest.mark.parametrize("method", METHODS)
def test_decoding(benchmark, bench_model, method):
    model, _, prompts, max_new = bench_model
    with torch.inference_mode():
        if "hf-greedy" not in _greedy:  # warm up and fix the reference once
            _greedy["hf-greedy"] = _run("hf-greedy", model, prompts[:1], 8)
            _greedy["ref"] = None
        result = {}

        def run():
            result["v"] = _run(method, model, prompts, max_new)

        benchmark.pedantic(run, rounds=1, iterations=1)
    outs, secs, forwards = result["v"]
    tokens = sum(len(o) for o in outs)
    if method == "hf-greedy":
        _greedy["ref"] = outs
        _greedy["tps"] = tokens / secs
    ref = _greedy.get("ref")
    benchmark.extra_info.update(
        method=method,
        prompts=len(prompts),
        max_new_tokens=max_new,
        new_tokens=tokens,
        seconds_with_prefill=secs,
        tokens_per_s=tokens / secs,
        tpf=tokens / forwards if forwards else None,
        speedup_vs_hf_greedy=(tokens / secs) / _greedy["tps"] if "tps" in _greedy else None,
        identical_to_greedy=(outs == ref) if ref is not None else None,
    )
    if ref is not None and method != "hf-prompt-lookup":
        assert outs == ref, f"{method} diverged from greedy"


# ---- block-size sweep (feeds the "tokens/s and TPF vs block size" figure) --------------------
# (method, block size, pool, lookup candidates): the paper's methods as they are, then ours
# with the context-lookup candidate row (the default for multiblock).
_SIZES = (4, 8, 16, 32, 64)
SWEEP = (
    [("jacobi", n, 0, False) for n in _SIZES]
    + [("multiblock", n, p, False) for n in _SIZES for p in (0, 4)]
    + [("multiblock", n, 4, True) for n in _SIZES]
)


@pytest.fixture(scope="module")
def sweep_prompts(bench_model, quick):
    import os

    model, _, prompts, max_new = bench_model
    k = 1 if quick else int(os.environ.get("JACOBI_BENCH_SWEEP_PROMPTS", "4"))
    new = max_new if quick else int(os.environ.get("JACOBI_BENCH_SWEEP_NEW_TOKENS", "128"))
    return prompts[:k], new


@pytest.mark.parametrize("baseline", ["hf-greedy", "hf-prompt-lookup", "multiblock"])
def test_sweep_reference(benchmark, bench_model, sweep_prompts, baseline):
    """The horizontal reference lines of the sweep figure, on the sweep's prompts: transformers
    greedy and prompt lookup, and our default (multiblock, tuned: what the settings in the
    sweep are the alternatives to)."""
    model = bench_model[0]
    prompts, new = sweep_prompts
    box = {}
    benchmark.pedantic(
        lambda: box.update(v=_run(baseline, model, prompts, new)), rounds=1, iterations=1
    )
    outs, secs, forwards = box["v"]
    tokens = sum(len(o) for o in outs)
    benchmark.extra_info.update(
        sweep=True,
        method="tuned" if baseline == "multiblock" else baseline,
        tokens_per_s=tokens / secs,
        tpf=tokens / forwards if forwards else None,
    )


@pytest.mark.parametrize(
    "method,n,pool,lookup",
    SWEEP,
    ids=[f"{m}-n{n}-p{p}" + ("-lookup" if lk else "") for m, n, p, lk in SWEEP],
)
def test_sweep(benchmark, bench_model, sweep_prompts, method, n, pool, lookup):
    model = bench_model[0]
    prompts, new = sweep_prompts
    box = {"tokens": 0, "forwards": 0, "seconds": 0.0}

    def run():
        for ids in prompts:
            r = generate(
                model,
                ids,
                max_new_tokens=new,
                method=method,
                block_size=n,
                num_blocks=2,
                pool_size=pool,
                lookup=lookup,
            )
            box["tokens"] += r.new_tokens
            box["forwards"] += r.forwards
            box["seconds"] += r.seconds + r.prefill_seconds

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(
        sweep=True,
        method=method,
        block_size=n,
        pool_size=pool,
        num_blocks=2,
        lookup=lookup,
        tokens_per_s=box["tokens"] / box["seconds"],
        tpf=box["tokens"] / box["forwards"],
    )
