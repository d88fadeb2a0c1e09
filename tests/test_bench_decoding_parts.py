"""The CPU-runnable parts of the GPU decoding bench (bench/bench_decoding.py): the pinned tuner,
the per-step times, the weight bytes of a step's read floor, a row's extra_info."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from jacobi_ext import generate
from jacobi_ext.decoding import engine
from jacobi_ext.models import tiny_llama

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_decoding.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decoding_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_pinned_tuner_keeps_its_first_choice(bench, monkeypatch) -> None:
    model = tiny_llama(vocab_size=64, seed=0)
    t = bench.PinnedTuner(model)
    picks = iter([("first",), ("second",)])
    monkeypatch.setattr(engine.Tuner, "choose", lambda self, *a, **k: next(picks))
    assert t.choose("jacobi") == ("first",) and t.choose("jacobi") == ("first",)
    t.observe(None, None, 1, 1, False, False, False, True)  # learns nothing, writes nothing
    t.save()


def test_a_calls_step_times_come_with_its_result(bench) -> None:
    model = tiny_llama(vocab_size=64, seed=0)
    ids = torch.tensor([[3, 5, 7, 9]])
    res = generate(model, ids, max_new_tokens=6, method="ar", eos_token_id=[])
    steps = res.step_seconds
    assert len(steps) == res.forwards and all(t > 0 for t in steps)
    assert bench.steady_ms(steps) > 0 and bench.steady_ms([]) is None


def test_weight_bytes_read(bench) -> None:
    model = tiny_llama(vocab_size=64, hidden_size=32, seed=0)  # untied LM head
    emb = model.get_input_embeddings().weight
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    assert bench.weight_bytes_read(model) == every - emb.numel() * emb.element_size()
    model.lm_head.weight = emb  # tied: the table is read once, as the head
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    assert bench.weight_bytes_read(model) == every


def test_row_info(bench) -> None:
    model = tiny_llama(vocab_size=64, seed=0).to(torch.bfloat16)
    r = dict(outs=[[1, 2, 3], [4, 5]], seconds=0.5, forwards=4, steps=[0.01, 0.03, 0.02],
             prefill=[0.1, 0.3], capture=0.0, host=0.0)  # fmt: skip
    info = bench.row_info("ar", model, r, prompts=2, max_new=8)
    assert info["device"] == "cpu" and info["dtype"] == "bfloat16" and info["method"] == "ar"
    assert info["steady_ms_per_step"] == pytest.approx(20.0)
    assert info["prefill_ms"] == pytest.approx(200.0)
    assert info["tokens_per_s"] == pytest.approx(10.0) and info["tpf"] == pytest.approx(1.25)


def test_step_ab_runs_on_a_cpu(tmp_path) -> None:
    """bench/step_ab.py (the GPU job's first decoding figure) runs here on a tiny model: both
    forwards timed, and their targets agree."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "step_ab.py"
    spec = importlib.util.spec_from_file_location("step_ab", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "ab.json"
    argv = ["--device", "cpu", "--dtype", "fp32", "--tiny", "--iters", "2", "--rounds", "2",
            "--widths", "1,8", "--json", str(out)]  # fmt: skip
    assert mod.main(argv) == 0
    res = json.loads(out.read_text())
    assert [r["lean"] for r in res["rows"]] == [False, False, True, True]
    forwards = [r["forward"] for r in res["rows"]]
    assert forwards[0] == "transformers" and forwards[2] == "LeanDecoder"
    assert all(r["ms_per_step"] > 0 for r in res["rows"]) and res["argmax_agree"] == "8/8"
