"""The fused verify-accept-recycle op and the decoding loop's own overhead.

Target (CPU): <= 20 us per verify_step call at n=64, K=2, pool 4; the host loop (argmax,
packing, the op, cache bookkeeping) <= 5% of a step's time.

    pytest bench/bench_verify.py --benchmark-json=out/verify.json
"""

from __future__ import annotations

import math

import pytest
import torch

from jacobi_ext import generate


def _step_inputs(n=64, K=2, pool=4, vocab=49152, candidates=2):
    g = torch.Generator().manual_seed(0)
    W = K * n
    main = torch.randint(0, vocab, (W,), generator=g)
    greedy0 = main.roll(-1).clone()
    greedy0[40:] = torch.randint(0, vocab, (W - 40,), generator=g)  # accept 41 tokens
    R = 1 + candidates
    tok = torch.full((R, W), -1, dtype=torch.long)
    gre = torch.full((R, W), -1, dtype=torch.long)
    tok[0], gre[0] = main, greedy0
    for r in range(1, R):
        tok[r, :n] = main[:n]
        gre[r, :n] = torch.randint(0, vocab, (n,), generator=g)
    row_len = torch.tensor([W] + [n] * candidates, dtype=torch.int32)
    ends = torch.tensor([n, 2 * n], dtype=torch.int32)
    init = torch.randint(0, vocab, (n,), generator=g)
    pool_t = torch.randint(0, vocab, (pool, W), generator=g)
    pool_t[:, 5] = greedy0[40]  # every pool entry holds the next seed: candidates are built
    pool_len = torch.full((pool,), W, dtype=torch.int32)
    head = torch.zeros(1, dtype=torch.int32)
    return (tok, gre, row_len, ends, init, pool_t, pool_len, head, math.ceil(0.85 * n), 2)


def test_verify_step_cpu_latency(benchmark):
    args = _step_inputs()
    op = torch.ops.jacobi_ext.verify_step
    out = benchmark(op, *args)
    assert out[1][1].item() == 41
    benchmark.extra_info.update(n=64, K=2, pool=4, target_us=20.0)


def test_decoding_loop_overhead(benchmark, bench_model):
    """Share of each step spent outside the model forward (res.verify_seconds / res.seconds)."""
    model, _, prompts, max_new = bench_model
    res_box = {}

    def run():
        res_box["r"] = generate(
            model,
            prompts[0],
            max_new_tokens=max_new,
            method="multiblock",
            block_size=16,
            num_blocks=2,
            pool_size=4,
        )

    benchmark.pedantic(run, rounds=1, iterations=1)
    r = res_box["r"]
    share = r.verify_seconds / r.seconds
    benchmark.extra_info.update(
        loop_share=share,
        forwards=r.forwards,
        per_step_overhead_ms=1e3 * r.verify_seconds / r.forwards,
    )
    assert 0.0 < share < 1.0


@pytest.mark.parametrize("q", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_forward_latency_vs_tokens(benchmark, bench_model, q, record_property):
    """The roofline this library tunes to: one decoding step of q new tokens over a 256-token
    cache, run as the engine runs it (static runtime; a CUDA graph replay on GPUs), beside the
    floor this machine allows (jacobi_ext.tools.roofline: max(weight bytes / read bandwidth,
    FLOPs / compute peak), both measured here and cached; the summary prints the table)."""
    from jacobi_ext.decoding.runtime import StepProbe
    from jacobi_ext.tools import roofline

    model, _, _, _ = bench_model
    probe = StepProbe(model, context=256, max_q=q)
    p = next(model.parameters())
    dev = p.device
    machine, cost = roofline.model_machine(model)
    floor = roofline.floor_seconds(machine, cost, q, 256)

    def fwd():
        probe(q)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    benchmark.pedantic(fwd, rounds=7, iterations=1, warmup_rounds=1)
    info = dict(
        tokens=q,
        read_gbps=round(machine.read_gbps, 2),
        peak_gflops=round(machine.peak_gflops, 1),
        weight_bytes=cost.weight_bytes,
        floor_ms=1e3 * floor,
    )
    measured = benchmark.stats.stats.median if benchmark.stats is not None else None
    if measured is not None:  # no stats under --benchmark-disable
        info["x_floor"] = round(measured / floor, 3)
    benchmark.extra_info.update(info)
    record_property("roofline", dict(info, machine=machine.describe(), seconds=measured))
