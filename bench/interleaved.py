"""Interleaved timing of the attention implementations (round-robin, medians).

On a shared machine whose speed swings with load, timing A fully and then B compares two
different machines; running A, B, C, A, B, C, ... and taking per-implementation medians keeps
the ratios honest. Reuses the implementations of bench_attention.py.

    python bench/interleaved.py --seq 4096 --dtype fp32 --variant noisy_context --mode fwdbwd
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--variant", default="noisy_context")
    ap.add_argument("--mode", default="fwdbwd", choices=["fwd", "fwdbwd"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--impls", default="jacobi,two_pass,sdpa_dense")
    args = ap.parse_args()
    layout = ba.layout_for(args.seq, args.variant)
    S, dt = layout.seq_len, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    grad_on = args.mode == "fwdbwd"
    q = torch.randn(ba.B, ba.HQ, S, ba.D).to(dt).requires_grad_(grad_on)
    k = torch.randn(ba.B, ba.HKV, S, ba.D).to(dt).requires_grad_(grad_on)
    v = torch.randn(ba.B, ba.HKV, S, ba.D).to(dt).requires_grad_(grad_on)
    g = torch.randn(ba.B, ba.HQ, S, ba.D).to(dt)
    runs = {}
    for name in args.impls.split(","):
        f = ba.make_impl(name, layout, q, k, v)
        if grad_on:
            runs[name] = lambda f=f: torch.autograd.grad(f(q, k, v), (q, k, v), g)
        else:
            runs[name] = lambda f=f: f(q.detach(), k.detach(), v.detach())
    a = torch.randn(2048, 2048)
    runs["matmul"] = lambda: a @ a
    times: dict[str, list[float]] = {n: [] for n in runs}
    for fn in runs.values():
        fn()
    for _ in range(args.rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {n: statistics.median(t) for n, t in times.items()}
    flops = 4 * ba.useful_pairs(layout) * ba.D * ba.HQ * (3.5 if grad_on else 1.0)
    mm_rate = 2 * 2048**3 / med["matmul"] / 1e9
    print(f"S={S} {args.dtype} {args.variant} {args.mode}  matmul {mm_rate:.0f} GFLOP/s")
    for name in runs:
        if name == "matmul":
            continue
        rate = flops / med[name] / 1e9
        rel = med[name] / med["jacobi"]
        print(
            f"  {name:11} {med[name] * 1e3:8.1f} ms  {rate:6.1f} GF/s  "
            f"{100 * rate / mm_rate:5.1f}% of matmul  jacobi is {rel:.2f}x faster"
        )


if __name__ == "__main__":
    main()
