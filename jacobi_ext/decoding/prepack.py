"""CPU linears from weights packed once: the runtime's forwards run every `nn.Linear` of the model
through our decode-shaped kernel (fp32 and bf16), or through oneDNN's packed bf16 op where that
was measured faster (a CPU with AMX).

Why: a decoding step multiplies a few rows by every weight of the model, so it is bound by
reading the weights. `F.linear` streams fp32 weights at about a third of the read bandwidth (MKL's
small-M path) and hands oneDNN a plain bf16 weight that it reorders on every call.
`torch.ops.jacobi_ext.cpu_linear` (csrc/cpu/linear_cpu.h) streams a packed copy at ~85 % of the
read bandwidth at one row and stays ahead of the library GEMM up to hundreds of rows
(`bench/bench_cpu_linear.py` measures it on the machine at hand). Each of its outputs is one fp32
chain over k in order, so a row's result does not depend on how many rows the step feeds: a
token's logits are the same bits in a 1-token and a 64-token forward, and every decoding method
returns exactly the tokens of our AR (float64 models are left on `F.linear`, exact as before).

Backends, per model (`backend(model)`):
  - "kernel": ours, for fp32 and bf16 CPU models (the default);
  - "onednn": oneDNN's packed bf16 op, bitwise `F.linear`'s outputs; chosen by default only for
    bf16 on a CPU with AMX, and only where it timed faster than ours on the model's own shapes
    (measured once per model and process: `_measured_bf16_choice`);
  - None: `F.linear` (float64 and float16 models, GPUs, or switched off).
JACOBI_EXT_CPU_LINEAR=0 switches our kernel off (fp32 then runs `F.linear`, bf16 oneDNN's packed
op as before it existed); =kernel or =onednn forces one. JACOBI_EXT_CPU_PREPACK=0 switches the
oneDNN packing off (both read in one place with the engine's other switches: options.py).

How: the runtime's forwards run inside `packed(model)`, which points each `nn.Linear`'s forward
at the packed copy of its weight for the duration of the call and restores it after, so the
user's model is untouched outside our steps (transformers' own `generate` in the same process
runs as it always did). Packed copies live on the model, made once and remade if a weight
changes (its tensor or its version counter). The cost is a second copy of the linear weights
(540 MB for SmolLM2-135M in fp32). Only under inference (no autograd through the packed ops).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time

import torch
from torch import nn

from .options import options

_ATTR = "_jacobi_ext_packed_linears"
_ACTIVE = "_jacobi_ext_packed_active"
_CHOICE = "_jacobi_ext_bf16_linear_choice"
_PACK_ROWS = 16  # oneDNN's batch hint for the layout; any row count runs from the same copy
BACKENDS = ("kernel", "onednn")


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


@functools.cache
def kernel_available() -> bool:
    """Our CPU linear op is built into this jacobi_ext."""
    from ..kernels._native import ops

    return hasattr(ops, "cpu_linear") and hasattr(ops, "cpu_linear_pack")


@functools.cache
def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU has AMX tiles for bf16 (where oneDNN's bf16 product may beat ours)."""
    try:
        with open(cpuinfo) as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


def backend(model) -> str | None:
    """Which packed linear the runtime's forwards of `model` use: "kernel", "onednn" or None
    (`F.linear`); see the module docstring for the rule and the environment switches."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or p.dtype not in (torch.float32, torch.bfloat16):
        return None
    opts = options()
    want = opts.cpu_linear
    onednn_ok = p.dtype == torch.bfloat16 and available() and opts.cpu_prepack
    if want == "off":
        return "onednn" if onednn_ok else None
    if want == "onednn":
        return "onednn" if onednn_ok else None
    if not kernel_available():
        return "onednn" if onednn_ok else None
    if want == "kernel" or p.dtype == torch.float32 or not (onednn_ok and cpu_has_amx()):
        return "kernel"
    return _measured_bf16_choice(model)


def has_kernel(op: str, device: torch.device) -> bool:
    """Whether torch.ops.jacobi_ext.<op> runs on `device` in this build (every op on a CPU and on
    meta tensors, through its fake; on CUDA in a CUDA build)."""
    if device.type in ("cpu", "meta"):
        return True
    key = device.type.upper()
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"jacobi_ext::{op}", key)


@functools.cache
def cuda_decode_available() -> bool:
    """This jacobi_ext has the CUDA decode ops (csrc/cuda/decode_cuda.cu): a CUDA build."""
    from ..kernels._native import ops

    if not hasattr(ops, "rope_attention"):
        return False
    cuda = torch.device("cuda")
    return all(
        has_kernel(op, cuda)
        for op in (
            "rope_attention", "rms_norm", "fused_add_rms_norm", "silu_and_mul",
            "kv_commit", "argmax", "qk_rms_norm_",
        )
    )  # fmt: skip


# Set by meta_as_cuda() (kernel_count._one_step): a model on the meta device stands for one on
# a GPU with a CUDA build, so that the kernel count (made on a CPU, shapes only) sees the CUDA
# path a GPU would run: the fused decode ops (their fake kernels run on meta).
_META_IS_CUDA = False


@contextlib.contextmanager
def meta_as_cuda():
    """Within: `cuda_decode_on(meta)` is True (the kernel count's view of a CUDA build)."""
    global _META_IS_CUDA
    was, _META_IS_CUDA = _META_IS_CUDA, True
    try:
        yield
    finally:
        _META_IS_CUDA = was


def cuda_decode_on(device: torch.device) -> bool:
    """Whether steps on `device` run the fused CUDA decode ops: a CUDA device with this build's
    ops, or (counting kernels, meta_as_cuda) the meta device. One predicate for every place that
    chooses them (the lean forward, the argmax, the K/V commit)."""
    if device.type == "cuda":
        return cuda_decode_available()
    return device.type == "meta" and _META_IS_CUDA


def lean_backend(model) -> str | None:
    """Which lean forward (lean.py) the model's steps can run on: "kernel" (a CPU model on our
    packed linears), "cuda" (a float32 / bfloat16 model on a CUDA device, with this build's CUDA
    decode ops), or None (transformers' forward). The model's class is checked in lean.py."""
    p = next(model.parameters(), None)
    if p is not None and p.device.type in ("cuda", "meta"):
        ok = p.dtype in (torch.float32, torch.bfloat16) and cuda_decode_on(p.device)
        return "cuda" if ok else None
    return "kernel" if backend(model) == "kernel" else None


def wanted(model) -> bool:
    """Whether `packed(model)` packs anything."""
    return backend(model) is not None


def _measured_bf16_choice(model) -> str:
    """bf16 on a CPU with AMX: oneDNN's packed product may beat our AVX-512 kernel there. Time
    both on the model's widest linear (its LM head, usually) at 1 and 16 rows, once per model and
    process, and keep the faster (the choice is measured, not assumed)."""
    cached = model.__dict__.get(_CHOICE)
    if cached is not None:
        return cached
    lins = [m for m in model.modules() if type(m) is nn.Linear]
    lin = max(lins, key=lambda m: m.weight.numel()) if lins else None
    choice = "kernel"
    if lin is not None:
        times = {}
        for b in BACKENDS:
            f = _PackedLinear(lin, b)
            if not f.refresh():
                continue
            xs = [torch.randn(1, r, lin.in_features).to(torch.bfloat16) for r in (1, 16)]
            with torch.inference_mode():
                for x in xs:
                    f(x)  # warm-up
                samples = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    for x in xs:
                        f(x)
                    samples.append(time.perf_counter() - t0)
            times[b] = statistics.median(samples)
        if times:
            choice = min(times, key=times.get)
    object.__setattr__(model, _CHOICE, choice)
    return choice


def _probe_sum(w: torch.Tensor) -> torch.Tensor:
    """A few values of a weight, summed in double: a 0-d tensor on the weight's device."""
    flat = w.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // 16)][:16].double().sum()


def _probe(w: torch.Tensor) -> float:
    """A few values of a weight, summed: changes when its data is rewritten in place. (A meta
    weight, in the kernel count, has no values: its version and identity stand alone.)"""
    if w.device.type == "meta":
        return 0.0
    return float(_probe_sum(w))


def probes(weights) -> dict[int, float]:
    """The probes of many weights at once, by id(weight): the same values as `_probe`, with one
    device -> host read for all of them (on a GPU a read per weight is a synchronisation each:
    ~200 a call for a 30-layer model)."""
    out = {id(w): 0.0 for w in weights if w.device.type == "meta"}
    real = [w for w in weights if w.device.type != "meta"]
    if len({w.device for w in real}) > 1:  # weights on several devices: a read each
        out.update({id(w): _probe(w) for w in real})
    elif real:
        values = torch.stack([_probe_sum(w) for w in real]).tolist()
        out.update(zip(map(id, real), values, strict=True))
    return out


def weight_stamp(w: torch.Tensor, probed: dict[int, float] | None = None) -> tuple:
    """What a packed copy of `w` was made from: the tensor itself (identity, not a clone), its
    version counter, and a probe of its values (writes through `.data`, as merging a LoRA
    adapter in place does, bump no version counter). `probed`: probes read at once (`probes`)."""
    if probed is not None and id(w) in probed:
        return (w, w._version, probed[id(w)])
    return (w, w._version, _probe(w))


def same_stamp(a: tuple | None, b: tuple | None) -> bool:
    """Whether two weight stamps describe the same, unchanged weight."""
    return a is not None and b is not None and a[0] is b[0] and a[1:] == b[1:]


class _PackedLinear:
    """The forward that replaces one nn.Linear's while a step runs."""

    __slots__ = (
        "module", "backend", "weight", "stamp", "packed", "bias", "out_features",
    )  # fmt: skip

    def __init__(self, module: nn.Linear, backend: str) -> None:
        self.module = module
        self.backend = backend
        self.weight = None  # the tensor the copy was made from (identity, not a clone)
        self.stamp = None
        self.packed = None
        self.bias = None
        self.out_features = module.out_features

    def refresh(self) -> bool:
        """Remake the packed copy if the weight changed; False if this backend cannot pack it."""
        w = self.module.weight
        stamp = weight_stamp(w)
        if same_stamp(stamp, self.stamp):
            return True
        if w.device.type != "cpu" or w.dim() != 2:
            return False
        with torch.no_grad():
            if self.backend == "kernel":
                if w.dtype not in (torch.float32, torch.bfloat16):
                    return False
                from ..kernels._native import ops

                self.packed = ops.cpu_linear_pack(w.detach())
            else:
                if w.dtype != torch.bfloat16:
                    return False
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_ROWS)
        self.weight, self.stamp = w, stamp
        self.out_features = w.shape[0]
        b = self.module.bias
        self.bias = None if b is None else b.detach()
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or x.dim() < 2 or torch.is_grad_enabled():
            return nn.functional.linear(x, self.module.weight, self.module.bias)
        if self.backend == "kernel":
            return torch.ops.jacobi_ext.cpu_linear(x, self.packed, self.out_features, self.bias)
        # transformers passes [B, Q, in]; oneDNN's op takes 2-D or 3-D input alike.
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _linears(model, which: str) -> list[_PackedLinear]:
    """The model's nn.Linear forwards to swap in for backend `which`, packed copies up to date.
    The module walk is done once per model and backend (it is most of the cost of entering
    `packed`)."""
    cache = model.__dict__.get(_ATTR)
    if cache is None:
        cache = {}
        object.__setattr__(model, _ATTR, cache)  # not a submodule, not a parameter
    lins = cache.get(which)
    if lins is None:
        lins = cache[which] = [
            _PackedLinear(m, which) for m in model.modules() if type(m) is nn.Linear
        ]
        # One backend's copies at a time: switching frees the other's (a second full copy).
        for other in [k for k in cache if k != which]:
            del cache[other]
    return [c for c in lins if c.refresh()]


@contextlib.contextmanager
def packed(model):
    """Run the model's CPU linears from packed weights inside the block (see the module
    docstring); a no-op where `backend(model)` is None, and inside a block that already packs."""
    if model.__dict__.get(_ACTIVE):
        yield
        return
    which = backend(model)
    if which is None:
        yield
        return
    lins = _linears(model, which)
    object.__setattr__(model, _ACTIVE, True)
    for c in lins:
        object.__setattr__(c.module, "forward", c)  # instance attribute shadows Linear.forward
    try:
        yield
    finally:
        for c in lins:
            c.module.__dict__.pop("forward", None)
        object.__setattr__(model, _ACTIVE, False)
