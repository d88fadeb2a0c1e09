import torch, time
from torch.profiler import profile, ProfilerActivity
from jacobi_ext.models import load_model
from jacobi_ext.hf import jacobi_layout
from python_training.trainer import TrainConfig, load_examples, example_at, _with_lora
from python_training.loss import example_loss
torch.set_num_threads(1)
cfg = TrainConfig(data=["/work/main/runs/fp_code_n16"], synthetic_fraction=1.0, random_phase=True, variant="clean_context",
                  ar_weight=1.0, consistency_reduction="mean", lora_rank=16)
model, tok = load_model(None, attn_implementation="jacobi"); model.train(); model.config.use_cache=False
model = _with_lora(model, cfg)
recs = load_examples(cfg)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
def step(i):
    ex = example_at(recs, cfg, i)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        parts = example_loss(model, ex, 1.0, 1.0, "mean")
    with jacobi_layout(ex.layout):
        parts.total.backward()
    opt.step(); opt.zero_grad()
    return ex.input_ids.numel()
step(0)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    t = time.perf_counter(); n = sum(step(i) for i in range(1, 6)); dt = time.perf_counter() - t
print(f"5 steps, {n} tokens, {dt:.1f} s, {n/dt:.0f} tok/s (1 thread, with the scale run beside it)")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=40))
