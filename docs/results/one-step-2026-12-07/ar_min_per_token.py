"""ms per token of whole `ar` calls (prefill included) on the shipped model, exact and on 8-bit
activations, the first HumanEval prompt in its chat form, 64 new tokens: the fastest and the
median of 7 calls in one process. A tighter A/B of the step's Python than whole-benchmark rows
on a noisy machine (run alternately against two installs with run_site.py):

    python run_site.py /tmp/basesite ar_min_per_token.py
"""

import json
import statistics
import time

from jacobi_ext import generate
from jacobi_ext.data import humaneval_input_ids, load_humaneval
from jacobi_ext.models import load_model

out = {}
for mode, int8 in (("exact", False), ("8-bit", True)):
    model, tok = load_model("smollm2-jf", int8_activations=int8)
    ids = humaneval_input_ids(tok, load_humaneval(limit=1)[0])
    generate(model, ids, max_new_tokens=16, method="ar", lookup=False)  # warm
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        r = generate(model, ids, max_new_tokens=64, method="ar", lookup=False)
        ts.append((time.perf_counter() - t) / int(r.lengths[0]) * 1e3)
    out[mode] = {
        "min_ms_per_token": round(min(ts), 3),
        "median": round(statistics.median(ts), 3),
        "tokens": int(r.lengths[0]),
    }
print(json.dumps(out))
