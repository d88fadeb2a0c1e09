"""The one-region team (csrc/cpu/team.h) on and off in one process (2026-12-05): a step's time
with JACOBI_EXT_CPU_TEAM=0 and =1 in turn, 10 rounds, medians and the median of the rounds'
ratios. Usage: python team_ab.py exact|int8 WIDTH MODEL|-  (MODEL: a load_model name)."""

import os
import statistics
import sys
import time

import numpy as np
import torch

from jacobi_ext.decoding.runtime import StepProbe
from jacobi_ext.models import load_model

torch.set_num_threads(2)
model, _ = load_model(
    None if sys.argv[3] == "-" else sys.argv[3], int8_activations=(sys.argv[1] == "int8")
)
q = int(sys.argv[2])
probe = StepProbe(model, context=200, max_q=q)


def med():
    for _ in range(10):
        probe(q)
    ts = []
    for _ in range(int(200 / q) + 5):
        t0 = time.perf_counter()
        probe(q)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


res = {"0": [], "1": []}
for _r in range(10):
    for v in ("0", "1"):
        os.environ["JACOBI_EXT_CPU_TEAM"] = v
        res[v].append(med())
print(
    sys.argv[1:],
    "off",
    round(np.median(res["0"]), 3),
    "on",
    round(np.median(res["1"]), 3),
    "median ratio",
    round(float(np.median(np.array(res["1"]) / np.array(res["0"]))), 3),
)
