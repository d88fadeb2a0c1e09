"""Which CPU mode decodes faster here (jacobi_ext/tools/modes.py, `jacobi-forcing info
--modes`, the demo's line): both modes timed on the model in front of it, the verdict read off
the times, the model left in the mode it was in, and a model without Q4_1 / Q8_0 codes told why
it has one mode."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from jacobi_ext.tools import modes as M

sys.path.insert(0, str(Path(__file__).parent))
from gguf_fixtures import tiny_config, write_tiny_model  # noqa: E402


@pytest.fixture
def codes_model(tmp_path):
    from jacobi_ext.models.quantized import build_on_codes

    cfg = tiny_config()
    path = write_tiny_model(tmp_path / "tiny.gguf", cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_on_codes(cfg, path)


def _state(model):
    from jacobi_ext.models.quantized import GGUFLinear, kv_cache_dtype

    return [m.int8 for m in model.modules() if isinstance(m, GGUFLinear)], kv_cache_dtype(model)


@pytest.mark.parametrize("start_int8", [False, True])
def test_both_modes_are_timed_and_the_model_keeps_its_mode(codes_model, start_int8, monkeypatch):
    from jacobi_ext.models.quantized import set_int8_activations

    if start_int8:
        set_int8_activations(codes_model)
    before = _state(codes_model)
    from jacobi_ext.decoding import runtime

    seen = []  # each timed forward's mode: its cache's type, its linears' 8-bit flag
    real = runtime.StepProbe.__call__

    def spy(self, q):
        seen.append((self.rt.kv_dtype, any(_state(codes_model)[0])))
        return real(self, q)

    monkeypatch.setattr(runtime.StepProbe, "__call__", spy)
    t = M.compare_modes(codes_model, context=16, steps=2, rounds=2)
    assert t.why_not is None and t.exact_ms > 0 and t.int8_ms > 0
    assert set(seen) == {(torch.float32, False), (torch.float16, True)}
    assert _state(codes_model) == before


def test_the_verdict_follows_the_times():
    fast8 = M.ModeTimes(exact_ms=6.0, int8_ms=4.0)
    assert fast8.faster == "int8" and fast8.speedup == pytest.approx(1.5)
    assert "--int8-activations" in fast8.advice() and "1.50x faster" in fast8.advice()
    slow8 = M.ModeTimes(exact_ms=4.0, int8_ms=5.0)
    assert slow8.faster == "exact" and slow8.speedup == pytest.approx(1.25)
    assert "exact mode (the default) is faster" in slow8.advice()
    assert M.ModeTimes(4.0, 5.0).as_dict()["faster"] == "exact"


def test_a_model_without_codes_has_one_mode():
    from jacobi_ext.models import tiny_llama

    model = tiny_llama(vocab_size=50, hidden_size=64, num_layers=1)
    t = M.compare_modes(model, context=8, steps=1, rounds=1)
    assert t.int8_ms is None and t.faster == "exact" and t.speedup is None
    assert "no Q4_1 / Q8_0 linear" in t.why_not and "exact mode only" in t.advice()
    assert "float32 model on a CPU" in M.why_no_int8(model.to(torch.bfloat16))


def test_info_says_how_to_measure_the_modes(capsys):
    from jacobi_ext.apps.cli import main

    assert main(["info"]) == 0
    assert "info --modes" in capsys.readouterr().out


def test_info_modes(monkeypatch, capsys):
    """`info --modes` prints the verdict of compare_modes on the model asked for (the loading
    and timing are stubbed here: the slow demo test runs them on the default model)."""
    import json

    from jacobi_ext.apps import cli
    from jacobi_ext.models import tiny_llama

    monkeypatch.setattr("jacobi_ext.models.load_model", lambda name: (tiny_llama(), None))
    monkeypatch.setattr(M, "compare_modes", lambda model: M.ModeTimes(6.0, 4.0))
    assert cli.main(["info", "--modes"]) == 0
    assert "8-bit activations are 1.50x faster" in capsys.readouterr().out
    assert cli.main(["info", "--modes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["modes"]["faster"] == "int8"
