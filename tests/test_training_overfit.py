"""The overfit proof: training on Jacobi states (fresh synthetic noise each step, the project's
packing + loss + trainer) makes plain Jacobi decoding converge in far fewer forwards on the
prompts it trained on, while staying identical to greedy.

The tiny model first memorises random answers (AR only), so its greedy answers are arbitrary
token strings: plain Jacobi then needs ≈ 1 forward per token (asserted). Only Jacobi Forcing
training can raise that, by teaching the model to predict tokens several places ahead of the
last correct one while the tokens in between are wrong.

Ceiling of plain Jacobi (this engine, docs/method.md §4): a block that starts from random draft
tokens needs at least two forwards (the first only confirms the seed, the second verifies the rest),
except the first block, whose draft comes from the uncounted prefill forward; with answers of
3 blocks of n=8 a perfect model reaches 24 / (1 + 2 + 2) = 4.8 tokens per forward.
"""

from __future__ import annotations

import time

import pytest
import torch

from python_training import overfit as of
from python_training.trainer import train

N = 8
STEPS = 300  # JF training steps of the tiny test (TPF 4.36 of the 4.8 ceiling at 300)


def test_jacobi_forcing_overfits_tiny_model(tmp_path):
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    task = of.make_task(num_prompts=4, prompt_len=8, answer_len=3 * N, vocab=128, n=N, seed=0)
    model = of.tiny_model(task.vocab, hidden=128, layers=4, seed=0)
    of.memorise(model, task, tmp_path, steps=200)
    base = of.jacobi_tpf(model, task.prompts, N, 3 * N)
    # The baseline is a real sequential decoder: memorised random answers (not a degenerate
    # repetition that Jacobi would decode for free), ~1 token per forward, lossless.
    assert base["answers"] == task.answers
    assert all(len(set(a)) > len(a) // 2 for a in base["answers"])
    assert base["identical"]
    assert base["tpf"] < 1.3, base

    data = of.collect_data(model, task, tmp_path, 3 * N, "fresh")
    cfg = of.Setting(steps=STEPS).train_config(str(data), str(tmp_path / "jf"))
    train(cfg, model=model, progress=False)
    after = of.jacobi_tpf(model, task.prompts, N, 3 * N)
    assert after["identical"], "plain Jacobi must stay identical to greedy"
    assert after["answers"] == task.answers  # the AR term kept the answers
    assert after["tpf"] >= N / 2, (base["tpf"], after["tpf"])
    print(f"TPF {base['tpf']:.2f} -> {after['tpf']:.2f} in {time.perf_counter() - t0:.1f} s")


@pytest.mark.slow
@pytest.mark.long
def test_jacobi_forcing_overfits_smollm2(tmp_path):
    """32 stdlib prompts, n=16, 64 new tokens: plain Jacobi TPF >= 3 on those prompts after
    training with fresh noise. The setting is the one that reached it (LoRA r16, bf16 autocast,
    lr 2e-3, 1500 steps: TPF 1.07 -> 6.12, 37 min on 1 thread of an Intel Xeon with AMX;
    docs/results/distill-cpu-2026-11-24/overfit_smollm2.jsonl); full fine-tuning at lr 1e-4
    and LoRA at 300-600 steps stopped at 1.23-1.77. bf16 autocast is slow on a CPU without
    AVX512-BF16: expect several times longer there."""
    # The base model's TPF (~1.05) is confirmed on 8 of the prompts: on 32 it costs ~15 min.
    setting = of.Setting(lr=2e-3, window=16, steps=1500,
                         extra={"lora_rank": 16, "mixed_precision": "bf16"})  # fmt: skip
    r = of.real_model_run(tmp_path, num_prompts=32, n=16, max_new_tokens=64, setting=setting,
                          base_prompts=8, heldout=4)  # fmt: skip
    print(r)
    assert r["identical_before"] and r["identical_after"]
    assert r["tpf_before"] < 1.5
    assert r["tpf_after"] >= 3.0, r
    assert r["heldout_identical"]
