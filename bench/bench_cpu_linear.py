"""bf16 linears on a CPU with AVX512-BF16 / AMX: `F.linear` against oneDNN-packed weights
(jacobi_ext/decoding/prepack.py), per layer shape and for a whole decoding step.

SmolLM2-135M-Instruct's shapes (576 -> 576 / 192 / 1536, 1536 -> 576, the 49 152-row LM head)
at 1 and 16 rows, and the runtime's step (StepProbe: 256 tokens of context) at widths 1, 4 and
16 with packing on and off. The two variants of one case run in the same benchmark, alternating
(A, B, A, B, ...), so load swings hit both; the medians and their ratio go into extra_info.

    pytest bench/bench_cpu_linear.py --benchmark-json=out/cpu_linear.json
    JACOBI_BENCH_QUICK=1 pytest bench/bench_cpu_linear.py     # tiny model, seconds
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

from jacobi_ext.decoding import prepack

QUICK = os.environ.get("JACOBI_BENCH_QUICK", "") not in ("", "0")
ROUNDS = 3 if QUICK else int(os.environ.get("JACOBI_BENCH_ROUNDS", "15"))

pytestmark = pytest.mark.skipif(
    not prepack.available(), reason="oneDNN bf16 packing needs a CPU with AVX512-BF16 / AMX"
)


def _alternate(a, b, rounds=ROUNDS) -> tuple[float, float]:
    """Medians (seconds) of a() and b() run alternately, after one warm-up call each."""
    a(), b()
    ta, tb = [], []
    for _ in range(rounds):
        for f, ts in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def _record(benchmark, plain: float, packed: float, **info) -> None:
    benchmark.extra_info.update(
        plain_ms=round(plain * 1e3, 3),
        packed_ms=round(packed * 1e3, 3),
        speedup=round(plain / packed, 3),
        **info,
    )


SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear(benchmark, shape, rows):
    out_f, in_f = (max(8, s // 64) for s in shape) if QUICK else shape
    lin = torch.nn.Linear(in_f, out_f, bias=False).to(torch.bfloat16)
    x = torch.randn(1, rows, in_f).to(torch.bfloat16)
    packed_forward = prepack._PackedLinear(lin)  # what a packed step calls in place of forward
    assert packed_forward.refresh()  # makes the packed copy

    def packed():
        return packed_forward(x)

    with torch.inference_mode():
        assert torch.equal(packed(), torch.nn.functional.linear(x, lin.weight))
        plain, pk = _alternate(lambda: torch.nn.functional.linear(x, lin.weight), packed)
        benchmark.pedantic(packed, rounds=1, iterations=1)
    _record(benchmark, plain, pk, shape=[out_f, in_f], rows=rows)


@pytest.fixture(scope="module")
def bf16_model():
    from jacobi_ext.models import load_model, tiny_llama

    if QUICK:
        return tiny_llama(vocab_size=128, seed=0).to(torch.bfloat16)
    return load_model(os.environ.get("JACOBI_BENCH_MODEL") or None, dtype=torch.bfloat16)[0]


@pytest.mark.parametrize("width", [1, 4, 16])
def test_decoding_step(benchmark, bf16_model, width, monkeypatch):
    """The runtime's step at `width` new tokens over 256 of context, packing on and off."""
    from jacobi_ext.decoding.runtime import StepProbe

    probe = StepProbe(bf16_model, context=32 if QUICK else 256, max_q=16)

    def run(env):
        def f():
            monkeypatch.setenv("JACOBI_EXT_CPU_PREPACK", env)
            return probe(width)

        return f

    assert torch.equal(run("0")(), run("1")())  # the same targets, bit for bit
    plain, pk = _alternate(run("0"), run("1"))
    benchmark.pedantic(run("1"), rounds=1, iterations=1)
    _record(benchmark, plain, pk, width=width, threads=torch.get_num_threads())
