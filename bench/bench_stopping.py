"""What stopping criteria cost a decode (jacobi_ext.decoding.stopping).

`transformers serve` (5.25 on) passes one criterion to every plain request, a cancellation check
(`stop_if_cancelled`: a set lookup, a [batch] tensor); a request's `stop` adds stop strings. Each
is asked once per committed position. Here the same calls run without a criterion, with the
server's, and with stop strings that never fire, interleaved round by round (A, B, C, A, B, C,
...) so that the machine's drifting pace falls on all three alike; the ratios of the medians are
the figures (extra_info: `ms_per_token_*`, `ratio_server`, `ratio_stop_strings`).

    pytest bench/bench_stopping.py --benchmark-json=out.json -o python_files=bench_*.py
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from jacobi_ext import generate

SETTINGS = {
    "ar": dict(method="ar"),
    "multiblock-16": dict(method="multiblock", block_size=16, num_blocks=2, pool_size=4),
}


def _server_criterion():
    """transformers serve's stop_if_cancelled, as it is written there: never fires here."""
    cancelled_ids: set[int] = set()

    def stop_if_cancelled(input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), 7 in cancelled_ids, device=input_ids.device)

    return stop_if_cancelled


@pytest.mark.parametrize("name", list(SETTINGS))
def test_stopping_criteria_cost(benchmark, bench_model, quick, name):
    model, tok, prompts, max_new = bench_model
    settings = SETTINGS[name]
    variants = {"none": {}, "server": {"stopping_criteria": [_server_criterion()]}}
    if tok is not None:  # a string no answer holds: asked at every position, never fires
        variants["stop_strings"] = {"stop_strings": ["\u2603\u2603"], "tokenizer": tok}
    rounds = 1 if quick else 5
    per_token: dict[str, list[float]] = {v: [] for v in variants}
    tokens: dict[str, list[list[int]]] = {v: [] for v in variants}

    def run():
        for ids in prompts[:1]:  # warm: the runtime, graphs, the tuner's curve
            generate(model, ids, max_new_tokens=max_new, **settings)
        for _ in range(rounds):
            for ids in prompts:
                for v, kw in variants.items():
                    t0 = time.perf_counter()
                    res = generate(model, ids, max_new_tokens=max_new, **settings, **kw)
                    per_token[v].append((time.perf_counter() - t0) / res.new_tokens)
                    tokens[v].append(res.tokens[0].tolist())

    benchmark.pedantic(run, rounds=1, iterations=1)
    for v in variants:  # a criterion that never fires changes no token
        assert tokens[v] == tokens["none"], v
    med = {v: statistics.median(t) for v, t in per_token.items()}
    info = {f"ms_per_token_{v}": 1e3 * m for v, m in med.items()}
    info["ratio_server"] = med["server"] / med["none"]
    if "stop_strings" in med:
        info["ratio_stop_strings"] = med["stop_strings"] / med["none"]
    info.update(method=name, prompts=len(prompts), max_new_tokens=max_new, rounds=rounds)
    benchmark.extra_info.update(info)
