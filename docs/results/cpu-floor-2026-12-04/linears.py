"""Every linear of a one-token forward of the default model, called alone, against torch's sum()
over the same packed bytes (2026-12-04). Usage: python linears.py exact|int8 [MODEL|-]"""

import statistics
import sys
import time

import torch

from jacobi_ext.decoding.runtime import StepProbe
from jacobi_ext.models import load_model

torch.set_num_threads(2)
mode = sys.argv[1]
name = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "-" else None
model, _ = load_model(name, int8_activations=(mode == "int8"))
probe = StepProbe(model, context=256, max_q=16)
probe(1)
lean = probe.rt._lean
calls = []  # (kind, fn, args): the lean forward's own calls
for plan in lean.plans:
    qkv_fn, qkv_args, o_fn, o_args = plan[0], plan[1], plan[6], plan[7]
    gu_fn, gu_args, down_fn, down_args = plan[10], plan[11], plan[13], plan[14]
    calls += [("qkv", qkv_fn, qkv_args), ("o", o_fn, o_args), ("gate_up", gu_fn, gu_args),
              ("down", down_fn, down_args)]  # fmt: skip
calls.append(("head", *lean.head.call()))
inputs = {"qkv": 576, "o": 576, "gate_up": 576, "down": 1536, "head": 576}
xs = {k: torch.randn(1, 1, v) for k, v in inputs.items()}


def median_seconds(fn, n=30):
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def linears(sel):
    return lambda: [fn(xs[kind], *args) for kind, fn, args in sel]


def plain(sel):
    bufs = [args[0].view(torch.uint8) for _, _, args in sel]
    views = [b.view(torch.float32) if b.numel() % 4 == 0 else b.float() for b in bufs]
    return lambda: [v.sum() for v in views]


for kind in [*inputs, "all"]:
    sel = calls if kind == "all" else [c for c in calls if c[0] == kind]
    nbytes = sum(args[0].numel() * args[0].element_size() for _, _, args in sel)
    t, r = median_seconds(linears(sel)), median_seconds(plain(sel))
    print(f"{mode} {kind:8s} {len(sel):3d} calls {nbytes / 1e6:6.1f} MB {t * 1e3:6.2f} ms "
          f"{nbytes / t / 1e9:5.1f} GB/s, sum() {nbytes / r / 1e9:5.1f} GB/s, "
          f"{t / len(sel) * 1e6:6.1f} us a call")  # fmt: skip
