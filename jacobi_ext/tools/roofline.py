"""The roofline of a decoding forward: what this machine allows a forward of q new tokens to
cost, to hold the measured forward-time curve against.

A forward streams the model's weights once, whatever q (at decoding widths the activations are
small), and does 2 FLOPs per linear weight per token plus the attention over the cache. So

    t_min(q) = max(weight_bytes / read bandwidth, FLOPs(q) / compute peak).

`machine()` measures the two ceilings (once per hardware / device / dtype / threads, cached as
JSON next to the tuner's profiles, ~0.2-0.4 s on a 2-core CPU), `for_working_set()` the read
bandwidth of as many bytes as a model's weights, read over and over (where they fit in a cache,
faster than memory); `model_cost()` reads the bytes and FLOPs off the model; `model_machine()`
gives both for a model; `floor_seconds()` combines them; `roofline_rows()` puts a measured
StepCurve beside the floor (`jacobi-forcing tune`, the forward-latency benchmark and plot).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..decoding.tuning import StepCurve

# .tuning is imported where it is used: the tuner imports this module, in either order.

#: Widths the roofline table shows by default (decoding widths: one token to a wide block).
ROOFLINE_SIZES = (1, 2, 4, 8, 16, 32, 64)
#: Label of the floor in tables and plots.
FLOOR_LABEL = "roofline floor max(bytes/BW, FLOPs/peak)"


@dataclass
class Machine:
    """This machine's ceilings for a forward in `dtype` on `device` with `threads` threads."""

    read_gbps: float  # read bandwidth (GB/s): median x.sum() over a buffer well beyond the LLC
    peak_gflops: float  # compute peak (GFLOP/s) in dtype: the faster of torch.mm and our kernel
    dtype: str  # str(torch.dtype), as StepCurve.dtype
    threads: int
    hardware: str
    device: str

    def describe(self) -> str:
        """One line for users: the two ceilings and what they were measured for."""
        return (
            f"machine: read bandwidth {self.read_gbps:.1f} GB/s, compute peak "
            f"{self.peak_gflops:.0f} GFLOP/s ({self.dtype.removeprefix('torch.')}, "
            f"{self.threads} threads, {self.hardware})"
        )


# ---------------------------------------------------------------------------------------------
# Measuring the machine


def _normalise(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _hardware(dev: torch.device) -> str:
    from ..decoding.tuning import cpu_name

    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()


def _machine_path(dev: torch.device, dtype: torch.dtype) -> Path:
    from ..decoding.tuning import cache_dir

    raw = f"{_hardware(dev)}|{dev}|{dtype}|{torch.get_num_threads()}"
    return cache_dir() / "machine" / f"{hashlib.sha1(raw.encode()).hexdigest()}.json"


def _llc_bytes() -> int:
    """Last-level cache size as the OS reports it for cpu0 (what lscpu shows); 32 MiB if unknown.
    (sysconf's LEVEL3_CACHE_SIZE is not used: in VMs it can report the host's total.)"""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for idx in base.glob("index*"):
            size = (idx / "size").read_text().strip().upper()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
            best = max(best, int(size.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        best = 0
    return best or 32 * 2**20


def _timed(fn, sync, repeats: int, slow: float) -> float:
    """Median seconds of `repeats` calls of fn after one warm-up call; where the warm-up alone
    took over `slow` seconds, its time is the answer (a slow path is not worth repeating)."""

    def once() -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    first = once()
    if first > slow:
        return first
    return statistics.median(once() for _ in range(repeats))


@torch.inference_mode()
def measure_machine(device: torch.device | str = "cpu", dtype=torch.float32) -> Machine:
    """Measure read bandwidth and compute peak now (see Machine). On a 2-core CPU ~0.2-0.4 s:
    a buffer of 8x the LLC (64-256 MB) read 3 times, torch.mm 1024^2 (2048^2 where one is
    expected within 25 ms) 3 times, our cpu_linear at M = 256 on a 1536x576 weight 5 times."""
    dev = _normalise(device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    # Read bandwidth: bytes are bytes, so the buffer is fp32 whatever the model's dtype (a sum
    # in bf16 converts on the fly and would measure the conversion, not the memory).
    nbytes = 2**30 if cuda else min(max(8 * _llc_bytes(), 64 * 2**20), 256 * 2**20)
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)  # touched: real pages
    read = _timed(buf.sum, sync, repeats=3, slow=0.5)
    del buf
    read_gbps = nbytes / read / 1e9

    gflops = []
    if cuda:
        sizes = (8192,)
    else:
        sizes = (1024, 2048)
    for n in sizes:  # torch's GEMM: the largest square size that stays cheap to time
        a = torch.randn(n, n, device=dev).to(dtype)
        b = torch.randn(n, n, device=dev).to(dtype)
        t = _timed(lambda a=a, b=b: torch.mm(a, b), sync, repeats=3, slow=0.1)
        gflops.append(2 * n**3 / t / 1e9)
        if cuda or t * 8 > 0.025:  # the next size costs 8x: time it only where that is cheap
            break
    if not cuda and dtype in (torch.float32, torch.bfloat16):
        from ..decoding.prepack import kernel_available

        if kernel_available():  # our decode-shaped kernel can beat torch's GEMM on a CPU
            from ..kernels._native import ops

            N, K, M = 1536, 576, 256
            packed = ops.cpu_linear_pack(torch.randn(N, K).to(dtype))
            x = torch.randn(M, K).to(dtype)
            t = _timed(lambda: ops.cpu_linear(x, packed, N, None), sync, repeats=5, slow=0.1)
            gflops.append(2 * M * N * K / t / 1e9)
    return Machine(
        read_gbps=read_gbps,
        peak_gflops=max(gflops),
        dtype=str(dtype),
        threads=torch.get_num_threads(),
        hardware=_hardware(dev),
        device=str(dev),
    )


@torch.inference_mode()
def for_working_set(m: Machine, nbytes: int) -> Machine:
    """`m` with the read bandwidth of a working set of `nbytes` read over and over (a CPU: a
    buffer that size read once, then the fastest of four reads; a GPU: `m` as it is), measured
    now. A forward reads the same weights every forward, so they stream from wherever a working
    set of their size settles, and a cache that holds them is faster than the memory
    Machine.read_gbps is measured against: on a 2-core Xeon with AMX (2026-12-01) 24-97 MB read
    over and over at 51-55 GB/s, 200-800 MB at 27-30, so the default GGUF model's 97 MB floor was
    put at half the pace its weights come at. ~5 reads of nbytes (~0.01-0.1 s)."""
    if m.device.startswith("cuda") or nbytes <= 0:
        return m
    return replace(m, read_gbps=reread_gbps(torch.ones(max(nbytes // 4, 1))))


def model_machine(model) -> tuple[Machine, ModelCost]:
    """The floor's inputs for `model`: this machine's ceilings for the model's device and dtype
    (machine()) with the read bandwidth of a working set of its weights' bytes
    (for_working_set), and the model's cost (model_cost)."""
    p = next(model.parameters())
    cost = model_cost(model)
    return for_working_set(machine(p.device, p.dtype), cost.weight_bytes), cost


@torch.inference_mode()
def reread_gbps(buf: torch.Tensor, reads: int = 4) -> float:
    """GB/s of `buf.sum()` on a CPU tensor read over and over: read once untimed, then the
    fastest of `reads` reads in a row (the pace of a working set of its size, where it settles)."""
    buf.sum()
    fastest = float("inf")
    for _ in range(reads):
        t0 = time.perf_counter()
        buf.sum()
        fastest = min(fastest, time.perf_counter() - t0)
    return buf.numel() * buf.element_size() / fastest / 1e9


_MEMO: dict[Path, Machine] = {}


def machine(
    device: torch.device | str = "cpu", dtype=torch.float32, remeasure: bool = False
) -> Machine:
    """This machine's ceilings for (hardware, device, dtype, threads): measured on first use
    (measure_machine), then read from `cache_dir()/machine/<sha1>.json`."""
    dev = _normalise(device)
    path = _machine_path(dev, dtype)
    if not remeasure:
        if path in _MEMO and path.is_file():
            return _MEMO[path]
        try:
            m = Machine(**json.loads(path.read_text()))
            _MEMO[path] = m
            return m
        except (OSError, ValueError, TypeError):
            pass  # absent or unreadable: measure
    m = measure_machine(dev, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(m), indent=1))
    tmp.replace(path)  # atomic: an interrupted write never leaves a broken file
    _MEMO[path] = m
    return m


# ---------------------------------------------------------------------------------------------
# What a forward of the model costs


@dataclass
class ModelCost:
    """Bytes a forward streams and the shapes its FLOPs follow from."""

    weight_bytes: int  # unique parameter storages, without an untied input embedding table
    linear_params: int  # weights of every nn.Linear (the LM head even when tied): 2 FLOPs/token
    layers: int
    q_heads: int
    head_dim: int

    def flops(self, q: int, context: int) -> float:
        """FLOPs of a forward of q new tokens over `context` cached ones: the linears, plus the
        attention's two products (scores and values) over context + q keys per layer and head."""
        attn = 4 * self.layers * self.q_heads * self.head_dim * q * (context + q)
        return 2.0 * self.linear_params * q + attn


def model_cost(model) -> ModelCost:
    """Read a ModelCost off a transformers causal LM. Tied weights count once (deduplicated by
    data_ptr). The input embedding table counts only where it is the output embeddings too: an
    untied one is gathered a row per token, never streamed."""
    from ..models.quantized import GGUFLinear

    emb_in = model.get_input_embeddings()
    emb_out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    w_in, w_out = getattr(emb_in, "weight", None), getattr(emb_out, "weight", None)
    skip = set()
    if w_in is not None:
        tied = w_out is not None and w_out.data_ptr() == w_in.data_ptr()
        if not tied:
            skip.add(w_in.data_ptr())
    seen: set[int] = set()
    weight_bytes = 0
    for p in model.parameters():
        ptr = p.data_ptr()
        if ptr in seen or ptr in skip:
            continue
        seen.add(ptr)
        weight_bytes += p.numel() * p.element_size()
    # Linears on GGUF codes (jacobi_ext.models.quantized): the packed codes they read (and a LoRA's
    # factors); a GGUF token embedding is gathered a row per token, like an untied table.
    ggufs = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    weight_bytes += sum(m.nbytes for m in ggufs)
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear_params += sum(m.in_features * m.out_features for m in ggufs)
    cfg = model.config
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return ModelCost(weight_bytes, linear_params, cfg.num_hidden_layers, heads, head_dim)


def floor_seconds(m: Machine, c: ModelCost, q: int, context: int) -> float:
    """t_min(q): the forward can be no faster than reading its weights once, nor than doing
    its FLOPs at the compute peak."""
    return max(c.weight_bytes / (m.read_gbps * 1e9), c.flops(q, context) / (m.peak_gflops * 1e9))


def floor_curve(m: Machine, c: ModelCost, curve: StepCurve) -> list[float]:
    """The floor (seconds) at each of curve.sizes, over the curve's context (for plots)."""
    return [floor_seconds(m, c, q, curve.context) for q in curve.sizes]


def roofline_rows(
    curve: StepCurve, m: Machine, c: ModelCost, sizes=ROOFLINE_SIZES
) -> list[tuple[int, float, float, float]]:
    """(q, measured ms, floor ms, measured / floor) for each q in `sizes` the curve covers
    (interpolated between its measured sizes, never extrapolated past its last one)."""
    rows = []
    for q in sizes:
        if q > max(curve.sizes):
            continue
        t = curve.time(q)
        f = floor_seconds(m, c, q, curve.context)
        rows.append((q, 1e3 * t, 1e3 * f, t / f))
    return rows
