"""Shared benchmark fixtures. JACOBI_BENCH_QUICK=1 runs every suite on tiny sizes (a tiny random
model, few prompts, one round) so CI can check that the suites still run."""

from __future__ import annotations

import os

import pytest
import torch

QUICK = os.environ.get("JACOBI_BENCH_QUICK", "") not in ("", "0")
# JACOBI_BENCH_DEVICE / JACOBI_BENCH_DTYPE (jacobi-forcing bench --device/--dtype): where and in
# what precision the decoding suites run (default: CPU, float32).
DEVICE = os.environ.get("JACOBI_BENCH_DEVICE", "cpu")


def _model_name() -> str | None:
    """JACOBI_BENCH_MODEL: a checkpoint directory (e.g. runs/smollm2_cpu/final) or .gguf to
    benchmark instead of the default SmolLM2-135M-Instruct."""
    return os.environ.get("JACOBI_BENCH_MODEL") or None


def pytest_benchmark_update_machine_info(config, machine_info):
    # Which model the decoding numbers are for travels with the JSON, so a re-render says it.
    machine_info["jacobi_bench_model"] = (
        "tiny random Llama (quick mode)" if QUICK else (_model_name() or "SmolLM2-135M-Instruct")
    )
    # ... and so do the settings that move the numbers, for a re-render on another shell.
    machine_info["torch_threads"] = torch.get_num_threads()
    machine_info["jacobi_bench_device"] = os.environ.get("JACOBI_BENCH_DEVICE", "cpu")
    machine_info["jacobi_bench_dtype"] = os.environ.get("JACOBI_BENCH_DTYPE", "float32")
    if torch.cuda.is_available() and machine_info["jacobi_bench_device"].startswith("cuda"):
        machine_info["gpu"] = torch.cuda.get_device_name()
    machine_info["torch_version"] = torch.__version__


def pytest_terminal_summary(terminalreporter):
    """The forward-latency benchmark's roofline (bench_verify.py): the machine's ceilings, the
    model's weight bytes, and per width the floor beside the measured time."""
    rows = [
        dict(r.user_properties)["roofline"]
        for r in terminalreporter.stats.get("passed", [])
        if r.when == "call" and "roofline" in dict(r.user_properties)
    ]
    if not rows:
        return
    rows.sort(key=lambda e: e["tokens"])
    tr = terminalreporter
    tr.section("roofline: forward latency vs its floor")
    tr.write_line(rows[0]["machine"])
    tr.write_line(
        f"model: {rows[0]['weight_bytes'] / 1e6:.1f} MB of weights read per forward; "
        "floor = max(bytes / bandwidth, FLOPs(q) / peak), cache of 256"
    )
    tr.write_line(f"{'tokens':>7} {'median ms':>10} {'floor ms':>9} {'x floor':>8}")
    for e in rows:
        s = e.get("seconds")
        measured = f"{1e3 * s:10.2f}" if s is not None else f"{'-':>10}"
        ratio = f"{1e3 * s / e['floor_ms']:8.2f}" if s is not None else f"{'-':>8}"
        tr.write_line(f"{e['tokens']:>7} {measured} {e['floor_ms']:9.2f} {ratio}")


@pytest.fixture(scope="session")
def quick() -> bool:
    return QUICK


@pytest.fixture(scope="session")
def bench_model():
    """(model, tokenizer-or-None, prompts as [1, P] id tensors, max_new_tokens)."""
    if QUICK:
        from jacobi_ext.models import tiny_llama

        model = tiny_llama(vocab_size=128, seed=0).to(DEVICE)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 128, (1, 12), generator=g).to(DEVICE) for _ in range(2)]
        return model, None, prompts, 16
    from jacobi_ext.data import humaneval_input_ids, load_humaneval
    from jacobi_ext.models import load_model

    n_prompts = int(os.environ.get("JACOBI_BENCH_PROMPTS", "20"))
    max_new = int(os.environ.get("JACOBI_BENCH_NEW_TOKENS", "256"))
    from jacobi_ext.models import DTYPE_NAMES

    dtype = DTYPE_NAMES[os.environ.get("JACOBI_BENCH_DTYPE", "float32")]
    model, tok = load_model(_model_name(), dtype=dtype, device=DEVICE)
    prompts = [humaneval_input_ids(tok, p).to(DEVICE) for p in load_humaneval(n_prompts)]
    # The tuner's forward-time curve is measured once per machine and cached: do it before any
    # timed run so "tuned" methods are not charged for it.
    from jacobi_ext.decoding.tuning import step_curve

    step_curve(model)
    return model, tok, prompts, max_new
