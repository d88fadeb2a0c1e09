"""CPU bf16 linears from weights packed once for oneDNN, bitwise equal to `F.linear`.

Why: on a CPU with AVX512-BF16 / AMX, `F.linear` on bf16 hands oneDNN a plain weight, which it
brings into its blocked layout on every call. Packed once, the 49 152-row LM head of
SmolLM2-135M took 5.3-5.5 ms instead of 7.2-8.4 ms, and the runtime's whole bf16 step 1.21-1.26x
less time at widths 1-16 (one thread, 2026-11-26; `bench/bench_cpu_linear.py` measures it on
the machine at hand). oneDNN computes the same blocks in the same order from the packed copy, so
the outputs are bitwise those of `F.linear` (tests/test_cpu_fast_paths.py checks it per shape
and over whole decodes), and every decoding method returns exactly the tokens it did before.

How: the runtime's forwards run inside `packed(model)`, which points each `nn.Linear`'s forward
at the packed copy of its weight for the duration of the call and restores it after, so the
user's model is untouched outside our steps (transformers' own `generate` in the same process
runs as it always did). Packed copies live on the model, made once and remade if a weight
changes (its tensor or its version counter).

Only bf16 weights on CPU under inference (no autograd through the packed op) are packed. fp32 is
left alone: oneDNN's packed fp32 product rounds differently from the MKL one `F.linear` uses,
which would break fp32's token-for-token equality with transformers' greedy. The cost is a
second copy of the linear weights (270 MB for SmolLM2-135M in bf16). JACOBI_EXT_CPU_PREPACK=0
turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch import nn

_ATTR = "_jacobi_ext_packed_linears"
_ACTIVE = "_jacobi_ext_packed_active"
_PACK_ROWS = 16  # oneDNN's batch hint for the layout; any row count runs from the same copy


@functools.cache
def available() -> bool:
    """oneDNN's packed linear is there and the CPU computes bf16 natively (AVX512-BF16 / AMX),
    which is where `F.linear` itself runs on oneDNN and the two agree bit for bit."""
    from ..models import cpu_has_bf16

    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and cpu_has_bf16()
    )


def wanted(model) -> bool:
    """Whether `packed(model)` packs anything: a CPU bf16 model, `available()`, env not 0."""
    if os.environ.get("JACOBI_EXT_CPU_PREPACK", "1").strip().lower() in ("0", "off", "false"):
        return False
    p = next(model.parameters(), None)
    return p is not None and p.device.type == "cpu" and p.dtype == torch.bfloat16 and available()


class _PackedLinear:
    """The forward that replaces one nn.Linear's while a step runs."""

    __slots__ = ("module", "weight", "version", "packed", "bias")

    def __init__(self, module: nn.Linear) -> None:
        self.module = module
        self.weight = None  # the tensor the copy was made from (identity, not a clone)
        self.version = -1
        self.packed = None
        self.bias = None

    def refresh(self) -> bool:
        """Remake the packed copy if the weight changed; False if it is no CPU bf16 weight."""
        w = self.module.weight
        if w is self.weight and w._version == self.version:
            return True
        if w.dtype != torch.bfloat16 or w.device.type != "cpu":
            return False
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_ROWS)
        self.weight, self.version = w, w._version
        b = self.module.bias
        self.bias = None if b is None else b.detach()
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() < 2 or torch.is_grad_enabled():
            return nn.functional.linear(x, self.module.weight, self.module.bias)
        # transformers passes [B, Q, in]; oneDNN's op takes 2-D or 3-D input alike.
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _linears(model) -> list[_PackedLinear]:
    """The model's nn.Linear forwards to swap in, packed copies up to date. The module walk is
    done once per model (it is most of the cost of entering `packed`)."""
    cached = model.__dict__.get(_ATTR)
    if cached is None:
        cached = [_PackedLinear(m) for m in model.modules() if type(m) is nn.Linear]
        object.__setattr__(model, _ATTR, cached)  # not a submodule, not a parameter
    return [c for c in cached if c.refresh()]


@contextlib.contextmanager
def packed(model):
    """Run the model's bf16 CPU linears from packed weights inside the block (see the module
    docstring); a no-op where `wanted(model)` is False, and inside a block that already packs."""
    if model.__dict__.get(_ACTIVE) or not wanted(model):
        yield
        return
    lins = _linears(model)
    object.__setattr__(model, _ACTIVE, True)
    for c in lins:
        object.__setattr__(c.module, "forward", c)  # instance attribute shadows Linear.forward
    try:
        yield
    finally:
        for c in lins:
            c.module.__dict__.pop("forward", None)
        object.__setattr__(model, _ACTIVE, False)
