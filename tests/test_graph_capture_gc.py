"""No garbage collection during a CUDA graph capture, and a failed capture's traceback logged
(graphs.py: no_gc, GraphReplay._capture). On a CPU machine: torch.cuda's stream and graph calls
are mocked, so the capture's own code runs as it would on a GPU, around a step that records what
it sees."""

from __future__ import annotations

import contextlib
import gc
import logging

import pytest
import torch

from jacobi_ext.decoding import runtime
from jacobi_ext.models import tiny_llama


class _Graph:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.replays = fail, 0

    def pool(self):
        return "pool"

    def replay(self) -> None:
        self.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as _capture calls it, on the CPU; `box["fail"] = True` makes capture raise."""
    box = {"fail": False}

    class Stream:
        def __init__(self, *a, **k) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

    @contextlib.contextmanager
    def graph(g, pool=None):
        if box["fail"]:
            raise RuntimeError("operation not permitted when stream is capturing")
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return box


def _runtime():
    rt = runtime.StaticRuntime(tiny_llama(vocab_size=32, seed=0), 1, 16, 4, cuda_graphs=False)
    rt.use_graphs = True  # as on a CUDA device: replay() captures
    return rt


def test_no_gc_during_capture_and_back_on_after(fake_cuda) -> None:
    rt = _runtime()
    seen = []

    def step():
        seen.append(gc.isenabled())
        return torch.zeros(1)

    assert gc.isenabled()
    rt.replay(("step", 1), step)
    assert seen == [False, False, False]  # two warm-up runs and the captured one
    assert gc.isenabled()
    assert isinstance(rt._graphs[("step", 1)][0], _Graph)
    rt.replay(("step", 1), step)  # a replay: no new capture, gc untouched
    assert len(seen) == 3 and gc.isenabled()


def test_gc_left_off_when_it_was_off(fake_cuda) -> None:
    rt = _runtime()
    gc.disable()
    try:
        rt.replay(("step", 1), lambda: torch.zeros(1))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_failed_capture_logs_its_traceback_and_turns_gc_back_on(fake_cuda, caplog) -> None:
    rt = _runtime()
    fake_cuda["fail"] = True
    calls = []
    with caplog.at_level(logging.WARNING, logger="jacobi_ext.decoding.runtime"):
        with pytest.warns(RuntimeWarning, match="CUDA graph capture failed"):
            out = rt.replay(("step", 1), lambda: calls.append(1) or torch.ones(1))
    assert gc.isenabled()
    assert not rt.use_graphs and out.item() == 1.0  # eager from now on, the step still ran
    rec = [r for r in caplog.records if "CUDA graph capture failed" in r.getMessage()]
    assert rec and rec[0].exc_info is not None
    assert "operation not permitted" in caplog.text and "Traceback" in caplog.text
