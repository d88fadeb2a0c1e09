"""The static runtime's CUDA graphs (runtime.StaticRuntime's graph side, in its own file).

On CUDA a decoding step (the whole step of the batch: step.BatchStep._step), a tuner probe (the
forward alone) and each prefill chunk run from a torch.cuda.CUDAGraph captured once per key (a
width bucket, a mix, a setting) and replayed, or through torch.compile(mode="reduce-overhead").
A capture that fails warns once, logs its traceback and runs eagerly: never a crash, never a
different token. Python's garbage collector is off while capturing (no_gc). The runtime drops
its graphs when what a captured step reads changes (StaticRuntime.step_reads, at each prefill).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import warnings

import torch

from .options import GRAPH_MODES, options

log = logging.getLogger("jacobi_ext.decoding.runtime")  # (the name users filter on)


@contextlib.contextmanager
def no_gc():
    """Python's garbage collector off for a CUDA graph capture (and its warm-up), on again after.
    Old runtimes sit in reference cycles (model -> runtime -> model); a collection that runs
    during a capture frees their graphs and memory pool on the capturing stream's device, which
    invalidates the capture (cudaErrorStreamCaptureInvalidated). One
    collection first, while nothing is being captured, frees them at a harmless moment."""
    was_on = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _graph_failure(what: str, exc: BaseException) -> None:
    """A failed capture or compile, said twice: a warning a user sees once, and the whole
    traceback in the log (logger jacobi_ext.decoding.runtime), so that the cause is not lost."""
    log.warning("jacobi_ext: %s failed; traceback:", what, exc_info=exc)
    warnings.warn(
        f"jacobi_ext: {what} failed ({type(exc).__name__}: {exc}); decoding eagerly instead "
        "(the traceback is logged by jacobi_ext.decoding.runtime)",
        RuntimeWarning,
        stacklevel=5,
    )


def graphs_wanted(device: torch.device, cuda_graphs: bool | str | None) -> str | None:
    """How CUDA steps run: "capture" (torch.cuda.CUDAGraph per width bucket, the default),
    "compile" (torch.compile(mode="reduce-overhead") of the same step) or None (eager). CPU
    steps always run eagerly. None = env JACOBI_EXT_CUDA_GRAPHS (0 / capture / compile)."""
    if cuda_graphs is None:
        cuda_graphs = options().cuda_graphs or False
    if cuda_graphs is True:
        cuda_graphs = "capture"
    if cuda_graphs is not False and cuda_graphs not in GRAPH_MODES:
        raise ValueError(
            f"cuda_graphs must be True / 'capture', 'compile', False or None, got {cuda_graphs!r}"
        )
    if device.type != "cuda" or cuda_graphs is False:
        return None
    return cuda_graphs


class GraphReplay:
    """The graph side of a StaticRuntime (a base class of it): replay a step function from a
    graph captured once per key. It works on the runtime's state: graph_mode, use_graphs, the
    captured graphs and their memory pool, the static buffers a step reads (_static_tensors),
    step_reads() (what else a captured step reads) and the timing counters."""

    def drop_graphs(self) -> None:
        """Forget every captured graph (and compiled step): the next replay of each key
        captures it again over what the forward reads now."""
        self._graphs.clear()
        self._pool = None
        self._captured_reads = None

    def replay(self, key, fn, neutral: tuple[torch.Tensor, ...] = ()):
        """fn() (no arguments; it reads and writes static buffers only, never a host value) from
        a CUDA graph captured once per key, or eagerly where graphs are off or capture failed.
        `neutral`: input buffers that, zeroed, make fn change no state (the warm-up runs before
        capture execute fn for real); they are zeroed for the warm-up and restored after.
        In "compile" mode fn runs through torch.compile(mode="reduce-overhead") instead (its
        first call per key compiles, and runs the real step)."""
        if self.graph_mode == "compile":
            return self._compiled_call(key, fn)
        if self.use_graphs:
            g = self._graphs.get(key) or self._capture(key, fn, neutral)
            if g is not None:
                g[0].replay()
                self.graph_replays += 1
                return g[1]
        return fn()

    def _compiled_call(self, key, fn):
        f = self._graphs.get(key)
        if f is not None:
            self.graph_replays += 1  # torch.compile's own CUDA graphs replay inside
            return f()
        t0 = time.perf_counter()
        cfg = torch._dynamo.config  # one compiled step per width bucket: room for all of them
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 64))
        for t in self._static_tensors():
            torch._dynamo.mark_static_address(t)  # mutated in place: graph inputs, fixed address
        f = torch.compile(fn, mode="reduce-overhead", dynamic=False)
        try:
            with no_gc():  # its first call records torch.compile's own CUDA graphs
                out = f()  # compiles (tracing and code generation happen before the step runs)
        except Exception as exc:  # like a failed capture: eager is slower, never wrong
            _graph_failure("torch.compile of the step", exc)
            self.graph_mode, self.use_graphs = None, False
            self._graphs.clear()
            out = fn()
        else:
            self._graphs[key] = f
            self._captured_reads = self.step_reads()
        torch.cuda.synchronize(self.device)
        self.warmup_seconds += time.perf_counter() - t0
        return out

    def _static_tensors(self):
        yield from (self.ids, self.seg, self.off, self.lo, self.hi)
        for layer in self.cache.layers:
            if layer.is_initialized:
                yield from (layer.keys, layer.values)
        for bs in self.batch_steps.values():
            yield from bs.state_tensors()

    def _capture(self, key, fn, neutral):
        t0 = time.perf_counter()
        saved = [t.clone() for t in neutral]
        try:
            with no_gc():
                for t in neutral:
                    t.zero_()
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):  # warm-up: lazy inits, kernel selection
                    for _ in range(2):
                        fn()
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    out = fn()
            self._pool = graph.pool()
            self._graphs[key] = (graph, out)
            self._captured_reads = self.step_reads()
            return self._graphs[key]
        except Exception as exc:  # an exotic model: eager is slower, never wrong
            _graph_failure("CUDA graph capture", exc)
            self.use_graphs = False
            self._graphs.clear()
            return None
        finally:
            for t, v in zip(neutral, saved, strict=True):
                t.copy_(v)
            torch.cuda.synchronize(self.device)
            self.warmup_seconds += time.perf_counter() - t0
