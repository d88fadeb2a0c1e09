"""Which CPU mode decodes faster on this machine: exact (the default) or 8-bit activations.

A GGUF model decoding on a CPU from the file's codes runs in one of two modes
(jacobi_ext.models.load_model):
- exact (the default): every linear is the fp32 product with the exactly dequantized weight,
  bitwise the model dequantized to fp32; the dequantization is arithmetic per weight;
- 8-bit activations (`int8_activations=True`, `--int8-activations`): each row of x quantized per
  block of 32 values and multiplied with the codes in integers, with a float16 K/V cache
  (llama.cpp's kind of arithmetic and its defaults): fewer instructions per weight.

Which one is faster depends on the machine: where the CPU's integer dot products (AVX512-VNNI,
AVX-VNNI) run the 8-bit tile near the read rate, 8-bit activations win (1.3-1.9x a one-token
forward on the machines measured so far); without them it may not. `compare_modes` measures a
one-token forward in each mode on the model in front of it, side by side (alternating rounds,
medians), and leaves the model in the mode it found. The demo and `jacobi-forcing info --modes`
print its verdict. Every method returns exactly its own mode's `ar` in either mode.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class ModeTimes:
    """A one-token forward's median time in each mode (int8_ms None where the mode does not
    apply, `why_not` saying why)."""

    exact_ms: float
    int8_ms: float | None
    why_not: str | None = None

    @property
    def faster(self) -> str:
        """ "int8" or "exact"."""
        return "int8" if self.int8_ms is not None and self.int8_ms < self.exact_ms else "exact"

    @property
    def speedup(self) -> float | None:
        """The faster mode's time over the slower one's (>= 1), None without both."""
        if self.int8_ms is None:
            return None
        return max(self.exact_ms, self.int8_ms) / min(self.exact_ms, self.int8_ms)

    def advice(self) -> str:
        """One sentence: which mode is faster here and how to pick either."""
        if self.int8_ms is None:
            return f"exact mode only ({self.why_not}); a one-token forward {self.exact_ms:.2f} ms"
        times = f"one-token forward {self.exact_ms:.2f} ms exact, {self.int8_ms:.2f} ms on 8-bit"
        if self.faster == "int8":
            return (
                f"8-bit activations are {self.speedup:.2f}x faster on this machine ({times}): "
                "pass --int8-activations (load_model(..., int8_activations=True)) to use them; "
                "exact, the default, is bitwise the fp32 model"
            )
        return (
            f"the exact mode (the default) is faster on this machine ({times}, "
            f"{self.speedup:.2f}x); --int8-activations is llama.cpp's kind of arithmetic"
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "faster": self.faster, "speedup": self.speedup}


def why_no_int8(model) -> str | None:
    """Why 8-bit activations do not apply to `model` (None: they do)."""
    from ..models.quantized import INT8_TYPES, GGUFLinear

    p = next(model.parameters(), None)
    if p is not None and (p.device.type != "cpu" or p.dtype != torch.float32):
        return f"8-bit activations need a float32 model on a CPU, not {p.dtype} on {p.device}"
    if not any(isinstance(m, GGUFLinear) and m.ggml_type in INT8_TYPES for m in model.modules()):
        return "the model has no Q4_1 / Q8_0 linear on its GGUF codes (dequantized or another type)"
    return None


def _mode_of(model) -> tuple[bool, torch.dtype | None]:
    from ..models.quantized import _KV_ATTR, GGUFLinear

    on = any(isinstance(m, GGUFLinear) and m.int8 for m in model.modules())
    return on, model.__dict__.get(_KV_ATTR)


def _set_mode(model, on: bool, kv: torch.dtype | None, int8_applies: bool) -> None:
    from ..models.quantized import set_int8_activations, set_kv_cache_dtype

    if int8_applies:
        set_int8_activations(model, on, fp16_kv_cache=False)
    set_kv_cache_dtype(model, kv)


@torch.inference_mode()
def compare_modes(model, context: int = 256, steps: int = 15, rounds: int = 3) -> ModeTimes:
    """The median one-token forward of `model` (its context `context` tokens) exact and on 8-bit
    activations with a float16 cache, measured in `rounds` alternating rounds of `steps` steps
    each after a warm-up. The model is left in the mode it was in."""
    from ..decoding.runtime import StepProbe

    was = _mode_of(model)
    why = why_no_int8(model)
    modes = {"exact": (False, None)}
    if why is None:
        modes["int8"] = (True, torch.float16)
    probes, times = {}, {name: [] for name in modes}
    try:
        for name, (on, kv) in modes.items():  # a probe each: its runtime's cache in its dtype
            _set_mode(model, on, kv, why is None)
            probes[name] = StepProbe(model, context=context, max_q=1)
        for _ in range(rounds):
            for name, (on, kv) in modes.items():
                _set_mode(model, on, kv, why is None)
                probe = probes[name]
                probe.rt._lean = None  # its next forward repacks for the mode, as a prefill does
                for _ in range(3):
                    probe(1)
                for _ in range(steps):
                    t0 = time.perf_counter()
                    probe(1)
                    times[name].append(time.perf_counter() - t0)
    finally:
        _set_mode(model, *was, why is None)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return ModeTimes(ms["exact"], ms.get("int8"), why)
