"""Python function calls (cProfile's count: deterministic, unlike a time on a noisy machine) of
one engine probe step (runtime.StepProbe, widths 1 and 16) and of whole greedy calls, on the
shipped model: what a change to the Python around the step adds or removes.

    python run_site.py /tmp/basesite python_calls.py
"""

import cProfile
import json
import pstats

import torch

from jacobi_ext import generate
from jacobi_ext.decoding.runtime import StepProbe
from jacobi_ext.models import load_model

model, tok = load_model("smollm2-jf")
probe = StepProbe(model, context=256, max_q=16)
out = {}
for q in (1, 16):
    probe(q)
    pr = cProfile.Profile()
    pr.enable()
    probe(q)
    pr.disable()
    out[f"probe q={q}"] = pstats.Stats(pr).total_calls
ids = torch.tensor([tok.encode("def fib(n):")])
for m in ("ar", "multiblock"):
    generate(model, ids, max_new_tokens=16, method=m, block_size=8, lookup=False)
    pr = cProfile.Profile()
    pr.enable()
    r = generate(model, ids, max_new_tokens=32, method=m, block_size=8, lookup=False)
    pr.disable()
    out[f"generate {m} 32 tokens ({r.forwards} forwards)"] = pstats.Stats(pr).total_calls
print(json.dumps(out))
