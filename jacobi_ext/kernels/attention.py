"""Block-causal attention: the general op and its Jacobi Forcing front end.

``block_attention(q, k, v, table)`` runs any :class:`~jacobi_ext.kernels.layout.BlockTable`;
``jacobi_attention(q, k, v, layout)`` runs a packed JF sequence. The latter has the kernel process
the tokens in the layout's stream order (prompt, clean blocks, noisy blocks): in that order almost
every tile the kernel visits is fully visible, so it does the useful work and little else (see
``JacobiLayout.stream_order``). The CPU kernel applies the order inside its own copy passes
(``block_attention_ordered_*`` ops); elsewhere the tokens are gathered and scattered around the
plain op.

Backends (``jacobi_attention(..., backend=...)``; the same names in the environment variable
``JACOBI_ATTN_KERNEL``, read at every call, so that a GPU run can compare them without code
changes; an explicit ``backend`` argument wins over the variable):

- ``auto`` (default): the compiled kernel of q's device (``cpu`` on CPU, ``sm90`` on compute
  capability 9, ``sm80`` on other GPUs), or FlexAttention for a CUDA head dim without a kernel;
  on CUDA, a backend that a GPU run measured fastest for the variant and head dim
  (``MEASURED_FASTEST``);
- ``cpu``: the CPU kernel;
- ``sm80``: the sm_80 CUDA kernel (A100, and the fallback everywhere);
- ``sm90``: the sm_90a CUDA kernel on compute capability 9.x; elsewhere, or where no sm_90a
  kernel exists for the dtype and head dim yet, the op runs the sm_80 one and warns once;
- ``flex``: torch's FlexAttention with the layout's block mask;
- ``streams``: two causal SDPA calls in stream order (``noisy_context`` only: see
  ``jacobi_ext/kernels/_attn_streams.py``).

As an argument, a backend that does not fit the inputs is a ValueError that names the ones that
do. From the environment, a backend is a preference for the whole run: it applies where it fits
and ``auto``'s choice runs elsewhere (``sm80``/``sm90`` leave CPU tensors on the CPU kernel and
CUDA head dims without a kernel on FlexAttention, ``streams`` leaves other layouts to ``auto``);
a value that is not a backend is a ValueError.

This module is the one place that decides (``choose_backend``, a pure function of the inputs'
device, compute capability, variant and head dim, of what fits, of the variable and of the
argument). The ops ``block_attention_fwd``/``bwd`` are always passed the kernel it picked by
name ("cpu", "sm80" or "sm90"), the backward by autograd too, and run that kernel: they never
read the environment, and a raw call with ``kernel=None`` runs the device's portable kernel
(``cpu`` on CPU, ``sm80`` on CUDA). ``block_attention`` takes its kernel from the same policy
(``op_kernel``: the variable where it names a kernel, else the default).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Collection, Sequence

import torch

from . import ops as _ops
from ._attn_streams import _PermuteTokens, is_two_stream, streams_attention
from ._native import ops
from .layout import BlockTable, JacobiLayout, StreamPlan, table_mask_mod

#: The backends of ``jacobi_attention`` (module docstring), also the values of KERNEL_ENV.
BACKENDS = ("auto", "cpu", "sm80", "sm90", "flex", "streams")
KERNEL_ENV = "JACOBI_ATTN_KERNEL"
#: Tile size (rows and key columns) of the sm_90a forward (csrc/cuda/attention/sm90/attention_sm90.h
#: kTileM/kTileN): its tile lists are built at this size.
SM90_TILE = 128
#: (CUDA compute capability major, variant, head dim) -> the backend a GPU run measured fastest
#: (bf16, fwd+bwd). ``auto`` takes it on CUDA where it fits; elsewhere ``auto`` keeps the compiled
#: kernel. Hopper, noisy_context, head dim 128 (7B shape Hq 28 / Hkv 4, S 4k and 16k): the two
#: causal streams beat the sm80 kernel 2.3x / 3.4x on an H100 and 2.6x / 3.5x on an H200
#: (docs/results/h100-2026-11-26, h200-2026-11-26), and the sm90 kernel, forward and backward,
#: ran 0.97x / 0.78x of them on an H200 (docs/results/h200-2026-11-28).
MEASURED_FASTEST: dict[tuple[int, str, int], str] = {(9, "noisy_context", 128): "streams"}
#: Whether ``auto`` runs the sm_90a kernel on compute capability 9 (where MEASURED_FASTEST names
#: nothing). Set since an H200 run (docs/results/h200-2026-11-28) passed every sm_90a attention
#: test (forward, backward in both dQ modes, every GPU attention test with sm90 as the kernel),
#: where the kernel ran fwd+bwd 2.1x / 2.8x faster than the sm_80 one (7B shape, 4k / 16k).
SM90_IS_DEFAULT = True
#: The backends that are compiled kernels of the ops (the names the ops take).
KERNELS = ("cpu", "sm80", "sm90")


def choose_backend(
    device_type: str,
    capability: int | None,
    variant: str | None,
    head_dim: int,
    fits: Collection[str],
    env: str | None = None,
    argument: str = "auto",
) -> tuple[str, str]:
    """The attention policy, as a pure function: (backend to run, why: "argument", "env" or
    "default").

    ``device_type``: q's (``"cpu"``, ``"cuda"``, ...); ``capability``: the CUDA compute capability
    major (None where unknown or not needed); ``variant``: the layout's (None for a bare block
    table); ``fits``: the backends that take the inputs (``"cpu"`` / ``"sm80"`` and ``"sm90"`` only
    where the device's compiled kernel does); ``env``: the value of ``JACOBI_ATTN_KERNEL`` (None:
    unset); ``argument``: ``jacobi_attention``'s ``backend``.

    In order: an ``argument`` other than "auto" runs (a ValueError where it does not fit); else a
    set ``env`` runs where it fits; else the default. On CUDA the default is FlexAttention where
    no compiled kernel fits, else MEASURED_FASTEST's backend for (capability, variant, head dim)
    where it fits, else ``sm90`` on capability 9 if SM90_IS_DEFAULT, else ``sm80``; on the CPU it
    is the CPU kernel; a device type with no compiled kernel family gets "auto" (the op's own
    dispatch). A name that is not a backend is a ValueError.
    """
    if not isinstance(argument, str) or argument not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {argument!r}")
    if argument != "auto":
        if argument not in fits:
            raise ValueError(
                f"backend={argument!r} does not take these inputs; backends that fit: "
                f"{', '.join(fits)}"
            )
        return argument, "argument"
    env = (env or "").strip()
    if env not in ("", "auto"):
        if env not in BACKENDS:
            raise ValueError(
                f"{KERNEL_ENV}={env!r} is not an attention backend; set it to one of "
                f"{', '.join(BACKENDS)} (or unset it)"
            )
        if env in fits:
            return env, "env"
    if device_type == "cuda":
        if "sm80" not in fits:
            return "flex", "default"
        measured = MEASURED_FASTEST.get((capability, variant, head_dim))
        if measured is not None and measured in fits:
            return measured, "default"
        return ("sm90" if SM90_IS_DEFAULT and capability == 9 else "sm80"), "default"
    return _ops.PORTABLE_KERNELS.get(device_type, "auto"), "default"


def _capability(q: torch.Tensor) -> int:
    return torch.cuda.get_device_capability(q.device)[0]


def op_kernel(q: torch.Tensor) -> str:
    """The kernel name the policy passes the ops for q outside ``jacobi_attention``'s backend
    choice: ``block_attention``'s, and that of tests and benchmarks that call the raw ops but
    should follow the policy. ``JACOBI_ATTN_KERNEL`` where it names a kernel of q's device, else
    the default kernel (``choose_backend`` with no variant: the measured table does not apply)."""
    device = q.device.type
    fits = {"cuda": ("sm80", "sm90"), "cpu": ("cpu",)}.get(device, ())
    capability = _capability(q) if device == "cuda" else None
    env = os.environ.get(KERNEL_ENV)
    return choose_backend(device, capability, None, q.shape[-1], fits, env)[0]


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() != 4 or t.stride(-1) == 1 else t.contiguous()


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: BlockTable,
    scale: float | None = None,
    order: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q over k, v restricted by a block-causal ``table``; returns [B, Hq, S, D].

    q: [B, Hq, S, D]; k, v: [B, Hkv, S, D] with Hq % Hkv == 0 (GQA, K/V never repeated);
    float32, bfloat16 or float16; differentiable in q, k, v. ``scale`` defaults to D**-0.5.
    ``order`` (optional): the order in which the kernel should process the blocks (new position
    -> block), e.g. one that makes each block's visible key blocks contiguous; the result is
    the same, only the speed changes (see ``BlockTable.reorder``).
    """
    q, k, v = _prepare(q, k, v)
    native = _ops.check_attention_inputs(q, k, v, allow_fallback=True)
    if q.shape[2] != table.seq_len:
        raise ValueError(
            f"q, k, v have seq_len {q.shape[2]} but the block table covers {table.seq_len} tokens; "
            "build the table for this sequence"
        )
    if not native:
        return _flex_attention(q, k, v, table.to(q.device), scale, key=table)
    kernel = op_kernel(q)
    if order is None:
        return _run(q, k, v, table.to(q.device), None, scale, kernel)
    reordered, perm = table.reorder(order)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    plan = StreamPlan(reordered, table.block_rows(order), perm, inv)
    return _run_plan(q, k, v, plan, scale, original=table, kernel=kernel)


def _prepare(q, k, v):
    # The one normalisation both front ends apply before validating: a unit head_dim stride
    # (the kernels read rows; every other stride is taken as it is).
    return tuple(_unit_last_stride(x) if isinstance(x, torch.Tensor) else x for x in (q, k, v))


def _run(
    q,
    k,
    v,
    table: BlockTable,
    block_row: torch.Tensor | None,
    scale: float | None,
    kernel: str | None = None,
):
    if scale is None:
        scale = q.shape[-1] ** -0.5
    _ops.check_block_table_tensors(q, *table.tensors())
    if block_row is None:
        lists = _sm90_tile_lists(q, table, kernel)
        out, _ = ops.block_attention_fwd(q, k, v, *table.tensors(), float(scale), kernel, lists)
    else:
        out, _ = ops.block_attention_ordered_fwd(q, k, v, *table.tensors(), block_row, float(scale))
    return out


def _sm90_tile_lists(q, table: BlockTable, kernel: str | None) -> list[torch.Tensor] | None:
    """The host-built tile lists of the sm_90a forward when it is the kernel that will run (else
    None): built once per table and device (a host copy of the table) and kept on the table.
    ``kernel``: the name the op is passed; the op says whether sm90 runs for it (fallbacks)."""
    if q.device.type != "cuda" or kernel != "sm90" or ops.attention_kernel(q, kernel) != "sm90":
        return None
    cache = table.__dict__.setdefault("_sm90_tile_lists", {})
    key = (q.device, q.shape[2])
    if key not in cache:
        cpu = [t.cpu() for t in table.tensors()]
        lists = ops.attention_tile_lists(*cpu, q.shape[2], SM90_TILE, SM90_TILE)
        cache[key] = [t.to(q.device) for t in lists]
    return cache[key]


def _run_plan(
    q,
    k,
    v,
    plan: StreamPlan,
    scale: float | None,
    original: BlockTable | None = None,
    kernel: str | None = None,
) -> torch.Tensor:
    device = q.device
    table, block_row = plan.table.to(device), plan.block_row.to(device)
    if _ops.has_kernel("block_attention_ordered_fwd", device):
        # The kernel reorders the tokens inside its own copy passes: no extra traffic.
        return _run(q, k, v, table, block_row, scale)
    if device.type == "cuda" and original is not None:
        # The CUDA kernels compute their own stream-order permutation from the table and read
        # rows through it (csrc/include/jacobi/attention_plan.h): gathering here would only add
        # six copies of q/k/v/out and their gradients.
        return _run(q, k, v, original.to(device), None, scale, kernel)
    # Devices without the ordered kernel: gather into processing order and back.
    perm, inv = plan.perm.to(device), plan.inv.to(device)
    qs, ks, vs = (_PermuteTokens.apply(x, perm, inv) for x in (q, k, v))
    return _PermuteTokens.apply(_run(qs, ks, vs, table, None, scale, kernel), inv, perm)


@torch.compiler.disable
def _stream_plan(layout: JacobiLayout, device: torch.device) -> StreamPlan:
    # Host-side bookkeeping (a few small int tensors, cached on the layout): kept out of
    # torch.compile graphs, whose tensors it only feeds as inputs.
    return layout.stream_plan(device)


@torch.compiler.disable
def _block_table(layout: JacobiLayout, device: torch.device) -> BlockTable:
    return layout.block_table(device)


def jacobi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: JacobiLayout,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over a packed Jacobi Forcing sequence with the layout's mask (docs/method.md §1).

    q: [B, Hq, S, D]; k, v: [B, Hkv, S, D]; Hq % Hkv == 0; S == layout.seq_len.
    Returns [B, Hq, S, D] in the packed order; differentiable in q, k, v.
    ``backend``: one of ``BACKENDS`` (see the module docstring); "auto" reads
    ``JACOBI_ATTN_KERNEL`` first.
    """
    q, k, v = _prepare(q, k, v)
    name, source = _resolve_backend(backend, q, k, v, layout)
    if q.shape[2] != layout.seq_len:
        raise ValueError(
            f"q, k, v have seq_len {q.shape[2]} but {layout} describes "
            f"P + 2*T*n = {layout.seq_len} tokens; pass the layout of this packed sequence"
        )
    if name == "streams":
        return streams_attention(q, k, v, layout, scale)
    if name == "flex":
        table = _block_table(layout, q.device)
        # Warned only where the default fell back to it (no compiled kernel for the head dim).
        return _flex_attention(q, k, v, table, scale, key=layout, warn=source == "default")
    plan, table = _stream_plan(layout, q.device), _block_table(layout, q.device)
    return _run_plan(q, k, v, plan, scale, original=table, kernel=name)


def _fitting_backends(q, k, v, two_stream: bool) -> list[str]:
    """The backends that take these inputs (``choose_backend``'s ``fits``, error messages);
    ``two_stream``: whether the layout is two causal streams (``is_two_stream``)."""
    fits = []
    if q.device.type == "cpu":
        fits.append("cpu")
    elif q.device.type == "cuda":
        try:
            if _ops.check_attention_inputs(q, k, v):
                fits += ["sm80", "sm90"]
        except ValueError:
            pass
    fits.append("flex")
    if two_stream:
        fits.append("streams")
    return fits


def _resolve_backend(backend, q, k, v, layout: JacobiLayout) -> tuple[str, str]:
    """(backend to run, why: "argument", "env" or "default"), decided by ``choose_backend``;
    validates the inputs for it first, so that an error names what is wrong with them."""
    # What every backend needs (shapes, dtypes, devices); the kernels' own rules come below.
    _ops.check_attention_inputs(q, k, v, kernel_rules=False)
    named = isinstance(backend, str) and backend in BACKENDS and backend != "auto"
    if named:
        _check_argument(backend, q, k, v, layout)
    env = os.environ.get(KERNEL_ENV)
    # noisy_context is two streams by definition; another variant only in degenerate shapes,
    # which is_two_stream finds by comparing block tables: host work that torch.compile must not
    # trace on every call, so it is done only where streams is asked for.
    asked = "streams" in (backend, (env or "").strip())
    two_stream = layout.variant == "noisy_context" or (asked and is_two_stream(layout))
    fits = _fitting_backends(q, k, v, two_stream)
    # The capability matters to the default only (the measured table, SM90_IS_DEFAULT).
    capability = _capability(q) if q.device.type == "cuda" and backend == "auto" else None
    name, source = choose_backend(
        q.device.type, capability, layout.variant, q.shape[-1], fits, env, backend
    )
    if source != "argument" and (
        name in (*KERNELS, "auto") or (name, source) == ("flex", "default")
    ):
        # The compiled kernels' rules: what neither a kernel nor the FlexAttention fallback of a
        # head dim without one takes is refused here, with the reason.
        _ops.check_attention_inputs(q, k, v, allow_fallback=True)
    return name, source


def _check_argument(backend: str, q, k, v, layout: JacobiLayout) -> None:
    """An explicit ``backend`` that does not fit the inputs: a ValueError saying why, with the
    backends that fit."""

    def fits() -> str:
        return ", ".join(_fitting_backends(q, k, v, is_two_stream(layout)))

    if backend == "streams" and not is_two_stream(layout):
        raise ValueError(
            f"backend='streams' needs a layout that is two causal streams sharing the prompt "
            f"(variant noisy_context, or a layout with the same mask); {layout} is not. "
            f"Backends that fit: {fits()}"
        )
    if backend == "cpu" and q.device.type != "cpu":
        raise ValueError(
            f"backend='cpu' is the CPU kernel but q is on {q.device}; backends that fit: {fits()}"
        )
    if backend in ("sm80", "sm90"):
        if q.device.type != "cuda":
            raise ValueError(
                f"backend={backend!r} is a CUDA kernel but q is on {q.device}; backends that "
                f"fit: {fits()}"
            )
        try:
            _ops.check_attention_inputs(q, k, v)
        except ValueError as e:
            raise ValueError(f"backend={backend!r}: {e}. Backends that fit: {fits()}") from None


# ---- FlexAttention: CUDA head dims without a compiled kernel ----------------------------------
_flex_warned: set[int] = set()
# Block masks per (layout or table, device): building one evaluates the mask_mod over the whole
# sequence, so it is done once. Tables are keyed weakly (by identity), layouts by value.
_flex_masks_by_layout: OrderedDict = OrderedDict()  # LRU: a training run may see many layouts
_FLEX_LAYOUT_CACHE = 32
_flex_masks_by_table: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# The FlexAttention mask of a block table (one definition, in layout.py beside this file).
flex_mask_mod = table_mask_mod


def _warn_flex(head_dim: int) -> None:
    if head_dim in _flex_warned:
        return
    _flex_warned.add(head_dim)
    warnings.warn(
        f"jacobi_ext: head dim {head_dim} has no compiled CUDA attention kernel (compiled: "
        f"{', '.join(map(str, _ops.CUDA_HEAD_DIMS))}); running FlexAttention with the layout's "
        "mask instead (correct, but slower). Pad the head dim to a compiled one for speed.",
        RuntimeWarning,
        stacklevel=3,
    )


@torch.compiler.disable
def _flex_block_mask(table: BlockTable, key, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    if isinstance(key, BlockTable):
        per_key = _flex_masks_by_table.setdefault(key, {})
    else:
        per_key = _flex_masks_by_layout.setdefault(key, {})
        _flex_masks_by_layout.move_to_end(key)
        while len(_flex_masks_by_layout) > _FLEX_LAYOUT_CACHE:
            _flex_masks_by_layout.popitem(last=False)
    dkey = str(device)
    if dkey not in per_key:
        S = table.seq_len
        per_key[dkey] = create_block_mask(
            flex_mask_mod(table), B=None, H=None, Q_LEN=S, KV_LEN=S, device=device
        )
    return per_key[dkey]


_compiled_flex = None


def _flex_fn(device: torch.device):
    """flex_attention, compiled once on CUDA (its eager form materialises the scores)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def _flex_attention(
    q, k, v, table: BlockTable, scale: float | None, key, warn: bool = True
) -> torch.Tensor:
    """The layout's attention through torch.nn.attention.flex_attention (same semantics as the
    kernels: GQA without repeating k/v, rows that see nothing give 0). ``warn``: say once per
    head dim that this is the slow fallback (not when the caller asked for it)."""
    if warn:
        _warn_flex(q.shape[-1])
    if scale is None:
        scale = q.shape[-1] ** -0.5
    block_mask = _flex_block_mask(table, key, q.device)
    gqa = q.shape[1] != k.shape[1]
    return _flex_fn(q.device)(q, k, v, block_mask=block_mask, scale=float(scale), enable_gqa=gqa)
