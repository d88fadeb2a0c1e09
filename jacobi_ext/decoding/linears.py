"""The linears of the lean forward (lean.py) and its greedy LM head.

- `_Packed`: on a CPU, one linear or several side by side along the outputs (q/k/v, gate/up)
  through our kernel, from weights packed once (prepack.py; repacked when a weight changes), or
  GGUF codes (jacobi_ext.models.quantized) packed at load;
- `_CatLinear`: on CUDA, the same as one torch linear (cuBLAS) over concatenated weights,
  rewritten in place when a weight changes (captured graphs keep reading the buffer);
- `_GreedyHead`: an exact GGUF LM head's argmax without its whole product.
Each gives `call()`: (fn, args) with fn(x, *args) the linear in the fewest Python frames, which
the layer plans (lean.LayerPlan) and the native layer loop read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.quantized import GGUFLinear
from .prepack import same_stamp, weight_stamp


class _Packed:
    """One linear of the lean forward (possibly several side by side along the outputs): fp32 /
    bf16 weights packed for our kernel (remade when any of them changes), or GGUF codes
    (jacobi_ext.models.quantized: packed once at load, side by side where the loader grouped
    them)."""

    __slots__ = ("mods", "stamp", "packed", "bias", "n", "splits", "calls")

    def __init__(self, *mods) -> None:
        self.mods = mods
        self.stamp = None
        self.splits = [m.out_features for m in mods]
        self.n = sum(self.splits)
        self.calls = _gguf_calls(mods) if any(isinstance(m, GGUFLinear) for m in mods) else None

    def refresh(self) -> None:
        if self.calls is not None:
            return  # GGUF codes do not change
        stamp = tuple(weight_stamp(m.weight) for m in self.mods)  # prepack.weight_stamp
        if self.stamp is not None and all(map(same_stamp, stamp, self.stamp)):
            return
        from ..kernels._native import ops

        with torch.no_grad():
            self.packed = ops.cpu_linear_pack_cat([m.weight.detach() for m in self.mods])
            self.bias = _cat_bias(self.mods)
        self.stamp = stamp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls is None:
            return torch.ops.jacobi_ext.cpu_linear(x, self.packed, self.n, self.bias)
        if len(self.calls) == 1:
            return self.calls[0](x)
        return torch.cat([c(x) for c in self.calls], dim=-1)

    def call(self) -> tuple:
        """(fn, args): fn(x, *args) is this linear with the fewest Python frames (the op's
        overload itself where one kernel call does it). Valid until the next refresh."""
        if self.calls is None:
            return torch.ops.jacobi_ext.cpu_linear.default, (self.packed, self.n, self.bias)
        if len(self.calls) == 1 and isinstance(self.calls[0], _GroupCall):
            return torch.ops.jacobi_ext.cpu_linear_gguf.default, self.calls[0].args()
        if len(self.calls) == 1 and isinstance(self.calls[0], _LinearCall):
            c = self.calls[0]
            return torch.ops.jacobi_ext.cpu_linear.default, (c.packed, c.n, c.bias)
        if len(self.calls) == 1 and isinstance(
            getattr(self.calls[0], "__self__", None), GGUFLinear
        ):
            return torch.ops.jacobi_ext.cpu_linear_gguf.default, self.calls[0].__self__.args()
        return self.__call__, ()


def _cat_bias(mods) -> torch.Tensor | None:
    bs = [m.bias for m in mods]
    if all(b is None for b in bs):
        return None
    return torch.cat([
        b.detach().float() if b is not None else torch.zeros(m.out_features)
        for b, m in zip(bs, mods, strict=True)
    ])  # fmt: skip


class _GroupCall:
    """Linears the GGUF loader packed side by side (q/k/v, gate/up): one kernel call, and their
    LoRAs (if any) as one: A stacked, each panel of B on its own linear's columns of x A^T."""

    __slots__ = ("group", "bias")

    def __init__(self, group, mods) -> None:
        self.group = group
        self.bias = _cat_bias(mods)

    def args(self) -> tuple:
        """cpu_linear_gguf's arguments after x."""
        g = self.group
        lora = (None, None, None) if g.lora is None else g.lora.args()
        return (g.packed, g.ggml_type, g.n, self.bias, *lora, g.int8)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.jacobi_ext.cpu_linear_gguf(x, *self.args())


class _LinearCall:
    """An fp32 nn.Linear beside GGUF linears (a tensor type the kernels do not read)."""

    __slots__ = ("packed", "n", "bias")

    def __init__(self, m: nn.Linear) -> None:
        from ..kernels._native import ops

        self.packed = ops.cpu_linear_pack(m.weight.detach())
        self.n, self.bias = m.out_features, _cat_bias([m])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.jacobi_ext.cpu_linear(x, self.packed, self.n, self.bias)


def _gguf_calls(mods) -> list:
    """The kernel calls that compute mods side by side: one where the loader grouped them."""
    group = getattr(mods[0], "group", None)
    if group is not None and group.mods == tuple(mods):
        return [_GroupCall(group, mods)]
    return [m.forward if isinstance(m, GGUFLinear) else _LinearCall(m) for m in mods]


class _CatLinear:
    """The CUDA forward's linear: one or several nn.Linear side by side along the outputs (q/k/v,
    gate/up) as one torch linear (cuBLAS) over their concatenated weights, made once and
    rewritten in place (the same buffer: captured CUDA graphs keep reading it) when any of them
    changes. A single linear uses the module's own weight."""

    __slots__ = ("mods", "stamp", "weight", "bias", "n", "splits")

    def __init__(self, *mods) -> None:
        self.mods = mods
        self.stamp = None
        self.weight = self.bias = None
        self.splits = [m.out_features for m in mods]
        self.n = sum(self.splits)

    def refresh(self, probed: dict[int, float] | None = None) -> None:
        """Rewrite the concatenated weights if any module's changed (`probed`: their probes,
        read for every linear at once by CudaLeanDecoder.refresh)."""
        stamp = tuple(weight_stamp(m.weight, probed) for m in self.mods)  # prepack.weight_stamp
        if self.stamp is not None and all(map(same_stamp, stamp, self.stamp)):
            return
        with torch.inference_mode():  # (the buffer may be an inference tensor: made in a step)
            if len(self.mods) == 1:
                m = self.mods[0]
                self.weight = m.weight.detach()
                self.bias = None if m.bias is None else m.bias.detach()
            else:
                weight = torch.cat([m.weight.detach() for m in self.mods])
                bias = None
                if any(m.bias is not None for m in self.mods):
                    bias = torch.cat([
                        m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
                        for m in self.mods
                    ])  # fmt: skip
                same = self.weight is not None and self.weight.shape == weight.shape
                if same and (bias is None) == (self.bias is None):
                    self.weight.copy_(weight)
                    if bias is not None:
                        self.bias.copy_(bias)
                else:
                    self.weight, self.bias = weight, bias
        self.stamp = stamp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def call(self) -> tuple:
        """(fn, args): fn(x, *args) is this linear (as _Packed.call)."""
        return F.linear, (self.weight, self.bias)


def _greedy_head(head) -> _GreedyHead | None:
    """The head's greedy form (cpu_linear_gguf_greedy), where it is one exact Q4_1 / Q8_0 GGUF
    linear without a bias or a LoRA (the 8-bit mode's head is already 8-bit: its own argmax)."""
    calls = getattr(head, "calls", None)
    if not calls or len(calls) != 1:
        return None
    m = getattr(calls[0], "__self__", None)
    if not isinstance(m, GGUFLinear) or m.ggml_type not in _GreedyHead.TYPES:
        return None
    if m.int8 or m.bias is not None or m.lora is not None:
        return None
    return _GreedyHead(m)


class _GreedyHead:
    """An exact GGUF LM head's argmax without its whole product: an 8-bit product of the hidden
    state and its residual, a rigorous error bound per vocabulary entry, and the exact fp32
    product on the few entries that can win (csrc/include/jacobi/greedy_screen.h). Bitwise the
    argmax of the exact logits (every tie, NaN and overflow included: such rows take the whole
    product). What it saves: docs/results/cpu-floor-2026-12-05."""

    TYPES = (3, 8)  # Q4_1, Q8_0: the types of the 8-bit kernel

    __slots__ = ("m",)

    def __init__(self, m: GGUFLinear) -> None:
        self.m = m
        if getattr(m, "_abs_sums", None) is None:  # once per weight (~20 ms for 49152 x 576)
            m._abs_sums = torch.ops.jacobi_ext.cpu_linear_gguf_abs_sums(
                m.packed, m.ggml_type, m.out_features, m.in_features
            )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.m
        return torch.ops.jacobi_ext.cpu_linear_gguf_greedy(
            x, m.packed, m.ggml_type, m.out_features, m._abs_sums
        )
