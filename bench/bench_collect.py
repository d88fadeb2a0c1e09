"""Collection for distillation: prompts per second against the batch size B
(python_training.trajectories.collect with batch_size=B: B left-padded prompts, one forward per
step for the batch), of fixed points (KV-cached greedy AR; JACOBI_BENCH_STATES=fixed_point, the
default) or of real Jacobi trajectories (JACOBI_BENCH_STATES=jacobi). Targets (CPU):
B = 8 at >= 4x the prompts/s of B = 1 for fixed points, >= 3x for trajectories. Every record
equals its prompt's batch-1 record (asserted in fp64 by tests/test_training_collect.py; counted
here as extra_info["identical_to_b1"]).

    JACOBI_BENCH_DTYPE=bfloat16 pytest bench/bench_collect.py --benchmark-json=out/collect.json

The same 16 training prompts (the shipped corpus) for every B, 64 new tokens (JACOBI_BENCH_*
variables as in conftest.py: _PROMPTS, _NEW_TOKENS, _DTYPE).
"""

from __future__ import annotations

import os

import pytest
import torch

from python_training.trajectories import collect, read_trajectories

_ANSWERS: dict[int, dict[str, list]] = {}
QUICK = os.environ.get("JACOBI_BENCH_QUICK", "") not in ("", "0")  # as in conftest.py
DEVICE = os.environ.get("JACOBI_BENCH_DEVICE", "cpu")
STATES = os.environ.get("JACOBI_BENCH_STATES", "fixed_point")
if STATES not in ("fixed_point", "jacobi"):
    raise ValueError(f"JACOBI_BENCH_STATES must be fixed_point or jacobi, got {STATES!r}")


@pytest.fixture(scope="module")
def collect_setup():
    if QUICK:
        from jacobi_ext.models import tiny_llama

        model = tiny_llama(vocab_size=128, seed=0).to(DEVICE)
        from python_training.prompts import Prompt

        prompts = [Prompt(f"p{i}", text="x") for i in range(4)]
        g = torch.Generator().manual_seed(0)
        ids = {p.id: torch.randint(4, 128, (1, 8 + i), generator=g) for i, p in enumerate(prompts)}
        return model, None, prompts, (lambda p: ids[p.id]), 16, (1, 2)
    from jacobi_ext.models import DTYPE_NAMES, load_model
    from python_training.prompts import load_prompts

    dtype = DTYPE_NAMES[os.environ.get("JACOBI_BENCH_DTYPE", "float32")]
    model, tok = load_model(None, dtype=dtype, device=DEVICE)
    prompts = load_prompts("code", int(os.environ.get("JACOBI_BENCH_PROMPTS", "16")))
    max_new = int(os.environ.get("JACOBI_BENCH_NEW_TOKENS", "64"))
    return model, tok, prompts, None, max_new, (1, 4, 8, 16)


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16])
def test_collect_prompts_per_second(benchmark, collect_setup, tmp_path_factory, batch):
    model, tok, prompts, encode, max_new, batches = collect_setup
    if batch not in batches:
        pytest.skip(f"B={batch} not in this mode's sweep {batches}")

    def run():
        d = tmp_path_factory.mktemp(f"collect-b{batch}")
        fixed = STATES == "fixed_point"
        collect(model, tok, prompts, d, block_size=16, max_new_tokens=max_new, progress=False,
                encode=encode, fixed_points_only=fixed, batch_size=batch)  # fmt: skip
        return d

    d = benchmark.pedantic(run, rounds=1, iterations=1)
    answers = {r["id"]: r["blocks"] for r in read_trajectories(d)}
    _ANSWERS[batch] = answers
    secs = benchmark.stats.stats.median
    benchmark.extra_info.update(
        batch=batch,
        states=STATES,
        forwards=sum(r["forwards"] for r in read_trajectories(d)),
        prompts=len(prompts),
        prompts_per_s=len(prompts) / secs,
        tokens=sum(r["new_tokens"] for r in read_trajectories(d)),
        identical_to_b1=(
            sum(answers[k] == _ANSWERS[1][k] for k in answers) if 1 in _ANSWERS else None
        ),
    )
