"""The decoding engine's environment switches, read in one place into one typed object.

Each switch was read where it was used (prepack, lean, runtime: ten reads in four files, each
parsing "off" its own way). `options()` reads them all at once: the engine asks it at each
prefill (a call's steps then agree), and parses a given environment once (cached on the values
of the switches, so a test that sets one sees it at the next call).

The switches a user may set (docs/decoding.md lists them too):

| variable | values | what |
|---|---|---|
| JACOBI_EXT_CUDA_GRAPHS | 1 / capture (default), compile, 0 | how CUDA steps run |
| JACOBI_EXT_PREFILL_CHUNK | N >= 0 | prompt tokens a prefill forward feeds (0: one pass) |
| JACOBI_EXT_CPU_LINEAR | auto (default), kernel, onednn, 0 | which CPU linear runs |

The others turn one of the engine's fast paths off, to compare it with the path it replaces (its
tests and benchmarks do; the output is the same tokens either way): JACOBI_EXT_LEAN (the lean
forward), JACOBI_EXT_FUSED (its fused ops), JACOBI_EXT_NATIVE (its one native call a step),
JACOBI_EXT_GREEDY_SCREEN (the exact GGUF head's greedy form), JACOBI_EXT_CPU_PREPACK (oneDNN's
packed bf16 linear). Off is "0", "off", "false" or "no" (any case); unset or anything else is on.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

OFF = ("0", "off", "false", "no")
GRAPH_MODES = ("capture", "compile")
CPU_LINEARS = ("auto", "kernel", "onednn", "off")

#: every variable options() reads, in the order of Options' fields
VARIABLES = (
    "JACOBI_EXT_LEAN", "JACOBI_EXT_FUSED", "JACOBI_EXT_NATIVE", "JACOBI_EXT_GREEDY_SCREEN",
    "JACOBI_EXT_CPU_LINEAR", "JACOBI_EXT_CPU_PREPACK", "JACOBI_EXT_CUDA_GRAPHS",
    "JACOBI_EXT_PREFILL_CHUNK",
)  # fmt: skip


@dataclass(frozen=True)
class Options:
    """The engine's switches (see the module docstring)."""

    lean: bool = True  # the lean forward (lean.py) where it applies
    fused: bool = True  # its fused ops (else the model's own norms, rotary and attention)
    native: bool = True  # its layers in one native call (LeanLayers)
    greedy_screen: bool = True  # an exact GGUF head's greedy form
    cpu_linear: str = "auto"  # CPU_LINEARS: which CPU linear (prepack.backend)
    cpu_prepack: bool = True  # oneDNN's packed bf16 linear may run
    cuda_graphs: str | None = "capture"  # GRAPH_MODES, or None: eager CUDA steps
    prefill_chunk: int | None = None  # prompt tokens a prefill forward feeds (None: by device)


def _on(value: str | None) -> bool:
    return value is None or value.strip().lower() not in OFF


@functools.lru_cache(maxsize=16)
def _parse(values: tuple[str | None, ...]) -> Options:
    lean, fused, native, screen, linear, prepack, graphs, chunk = values
    linear = (linear or "auto").strip().lower()
    if linear in OFF:
        linear = "off"
    elif linear not in CPU_LINEARS:
        linear = "auto"  # (an unknown word leaves the choice to the engine, as before)
    mode = (graphs or "capture").strip().lower()
    cuda_graphs = None if mode in OFF else (mode if mode in GRAPH_MODES else "capture")
    prefill = None
    if chunk is not None and chunk.strip():
        try:
            prefill = int(chunk)
        except ValueError:
            prefill = -1
        if prefill < 0:
            raise ValueError(
                f"JACOBI_EXT_PREFILL_CHUNK must be a token count >= 0 (0: one pass), got {chunk!r}"
            )
    return Options(
        lean=_on(lean), fused=_on(fused), native=_on(native), greedy_screen=_on(screen),
        cpu_linear=linear, cpu_prepack=_on(prepack), cuda_graphs=cuda_graphs,
        prefill_chunk=prefill,
    )  # fmt: skip


def options() -> Options:
    """The switches as the environment sets them now."""
    return _parse(tuple(os.environ.get(v) for v in VARIABLES))
