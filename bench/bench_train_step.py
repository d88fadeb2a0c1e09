"""One distillation training step (python_training): tokens/s of the optimizer step as the
trainer runs it (packed example with fresh synthetic noise, one `attn_implementation="jacobi"`
forward, AR + consistency loss, backward inside the layout, AdamW), for the settings a CPU run
chooses between: LoRA or full fine-tuning, fp32 or bf16 autocast, and under LoRA + bf16 the
frozen base weights cast once (trainer.FrozenLinearsBF16) or at every forward (plain autocast).

    OMP_NUM_THREADS=1 pytest bench/bench_train_step.py --benchmark-json=out/train_step.json

Every setting runs the same examples (the shipped SmolLM2 fixed points, n = 16; the recipe's
settings), one warm-up step, then JACOBI_BENCH_STEPS (default 6) timed steps per round.
bf16 pays only on a CPU with AVX512-BF16 / AMX (`lscpu`); without, it is emulated and slow.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

QUICK = os.environ.get("JACOBI_BENCH_QUICK", "") not in ("", "0")  # as in conftest.py
ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {  # name -> (lora rank, mixed precision, frozen bf16 copies)
    "lora-fp32": (16, "no", False),
    "lora-bf16-autocast": (16, "bf16", False),
    "lora-bf16": (16, "bf16", True),
    "full-fp32": (0, "no", False),
    "full-bf16": (0, "bf16", False),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from python_training.trainer import TrainConfig

    kw = dict(synthetic_fraction=1.0, random_phase=True, variant="clean_context", ar_weight=1.0,
              consistency_reduction="mean", window=16)  # fmt: skip
    if QUICK:
        from python_training.overfit import write_fixed_points

        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(4, 128, (10,), generator=g).tolist() for _ in range(4)]
        answers = [torch.randint(4, 128, (32,), generator=g).tolist() for _ in range(4)]
        d = write_fixed_points(tmp_path_factory.mktemp("fp"), prompts, answers, 16)
        return TrainConfig(data=[str(d)], **kw), 2
    d = ROOT / "python_training" / "data" / "fixed_points" / "smollm2-n16"
    return TrainConfig(data=[str(d)], **kw), int(os.environ.get("JACOBI_BENCH_STEPS", "6"))


def _model():
    if QUICK:
        from jacobi_ext.models import tiny_llama

        return tiny_llama(vocab_size=128, seed=0, attn_implementation="jacobi")
    from jacobi_ext.models import load_model

    return load_model(None, attn_implementation="jacobi")[0]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_train_step_tokens_per_second(benchmark, data, setting):
    from dataclasses import replace

    from jacobi_ext.hf import jacobi_layout
    from python_training.loss import example_loss
    from python_training.trainer import (
        FrozenLinearsBF16,
        _with_lora,
        example_at,
        load_examples,
    )

    cfg, steps = data
    rank, precision, frozen = SETTINGS[setting]
    cfg = replace(cfg, lora_rank=rank, mixed_precision=precision)
    model = _model()
    model.train()
    model.config.use_cache = False
    if rank:
        model = _with_lora(model, cfg)
        if frozen:
            FrozenLinearsBF16(model)
    records = load_examples(cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    auto = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    state = {"i": 0, "tokens": 0}

    def step():
        ex = example_at(records, cfg, state["i"])
        state["i"] += 1
        with auto:
            parts = example_loss(model, ex, 1.0, 1.0, "mean")
        with jacobi_layout(ex.layout):
            parts.total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return ex.input_ids.numel()

    step()  # warm-up: allocations, oneDNN kernels

    def run():
        t0, n = time.perf_counter(), sum(step() for _ in range(steps))
        state["tokens"] = n
        return time.perf_counter() - t0

    benchmark.pedantic(run, rounds=1, iterations=1)
    secs = benchmark.stats.stats.median
    benchmark.extra_info.update(
        setting=setting,
        steps=steps,
        tokens=state["tokens"],
        tokens_per_s=state["tokens"] / secs,
        seconds_per_step=secs / steps,
        threads=torch.get_num_threads(),
        trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
    )
