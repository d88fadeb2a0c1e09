"""Where a CPU decoding step's time goes (2026-12-05): a one-token step split into the layers (one
LeanLayers call), the LM head and the rest (Python: embedding, rotary tables, the pick); the step
against the context it attends (16 .. 512 slots); the step against its width (1 .. 64 tokens).
Medians of medians, each setting measured in turn within one process.

Usage: python step_parts.py exact|int8 [MODEL|-]   (MODEL: a load_model name, - the default)
"""

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


def median_ms(fn, rounds=8, calls=20):
    meds = []
    for _ in range(rounds):
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        meds.append(statistics.median(ts))
    return statistics.median(meds) * 1e3


# 1. One token, 200 slots of context: layers / head / rest.
probe = StepProbe(model, context=200, max_q=64)
probe(1)
lean = probe.rt._lean
spent = {"layers": [], "head": []}
native, head = lean.native, lean._head


class Timed:
    def run(self, *args):
        t0 = time.perf_counter()
        out = native.run(*args)
        spent["layers"].append(time.perf_counter() - t0)
        return out


def timed_head(x, keep, *rest):  # (rest: the greedy flag of the fourth session)
    t0 = time.perf_counter()
    out = head(x, keep, *rest)
    spent["head"].append(time.perf_counter() - t0)
    return out


lean.native, lean._head = Timed(), timed_head
for _ in range(20):
    probe(1)
for v in spent.values():
    v.clear()
step = median_ms(lambda: probe(1))
layers = statistics.median(spent["layers"]) * 1e3
lm_head = statistics.median(spent["head"]) * 1e3
lean.native, lean._head = native, head
print(f"{mode} {name or 'base'}: one-token step {step:.2f} ms = layers {layers:.2f} + head "
      f"{lm_head:.2f} + rest {step - layers - lm_head:.2f}")  # fmt: skip

# 2. One token against the context.
contexts = (16, 128, 256, 512)
probes = {c: StepProbe(model, context=c, max_q=1) for c in contexts}
for p in probes.values():
    p(1)
by_context = {c: median_ms(lambda p=p: p(1)) for c, p in probes.items()}
print("  context: " + ", ".join(f"{c}: {v:.2f}" for c, v in by_context.items()) + " ms")

# 3. The width of a step (200 slots of context).
widths = (1, 2, 4, 8, 16, 32, 64)
for q in widths:
    probe(q)
by_width = {q: median_ms(lambda q=q: probe(q), rounds=5, calls=8) for q in widths}
print("  width: " + ", ".join(f"{q}: {v:.2f}" for q, v in by_width.items()) + " ms")
