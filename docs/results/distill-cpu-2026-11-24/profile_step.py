"""Where a training step's time goes (profile_lora_bf16_step.txt): the scale run's step (LoRA
r16, bf16 autocast, clean_context, fresh synthetic noise) on the shipped fixed points, 5 steps
under the torch profiler, 1 thread.

    python docs/results/distill-cpu-2026-11-24/profile_step.py
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from jacobi_ext.hf import jacobi_layout
from jacobi_ext.models import load_model
from python_training.loss import example_loss
from python_training.trainer import TrainConfig, _with_lora, example_at, load_examples

DATA = "python_training/data/fixed_points/smollm2-n16"


def main() -> None:
    torch.set_num_threads(1)
    cfg = TrainConfig(
        data=[DATA], synthetic_fraction=1.0, random_phase=True, variant="clean_context",
        ar_weight=1.0, consistency_reduction="mean", lora_rank=16,
    )  # fmt: skip
    model, _ = load_model(None, attn_implementation="jacobi")
    model.train()
    model.config.use_cache = False
    model = _with_lora(model, cfg)
    recs = load_examples(cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step(i: int) -> int:
        ex = example_at(recs, cfg, i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            parts = example_loss(model, ex, 1.0, 1.0, "mean")
        with jacobi_layout(ex.layout):  # checkpointed layers recompute attention in backward
            parts.total.backward()
        opt.step()
        opt.zero_grad()
        return ex.input_ids.numel()

    step(0)  # warm-up, outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        n = sum(step(i) for i in range(1, 6))
        dt = time.perf_counter() - t
    print(f"5 steps, {n} tokens, {dt:.1f} s, {n / dt:.0f} tok/s (1 thread)")
    table = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=40
    )
    print(table)


if __name__ == "__main__":
    main()
