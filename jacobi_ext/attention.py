"""Block-causal attention: the general op and its Jacobi Forcing front end.

``block_attention(q, k, v, table)`` runs any :class:`~jacobi_ext.layout.BlockTable`;
``jacobi_attention(q, k, v, layout)`` runs a packed JF sequence. The latter reorders the tokens
into the layout's stream order (prompt, clean blocks, noisy blocks) before the kernel and back
after it: in that order almost every tile the kernel visits is fully visible, so it does the
useful work and little else (see ``JacobiLayout.stream_order``).
"""

from __future__ import annotations

import torch

from . import ops as _ops
from ._native import ops
from .layout import BlockTable, JacobiLayout


class _PermuteTokens(torch.autograd.Function):
    """x.index_select(2, perm) whose backward is the gather by the inverse permutation
    (exact and cheap, where index_select's own backward would scatter-add into zeros)."""

    @staticmethod
    def forward(x, perm, inv):
        return x.index_select(2, perm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])

    @staticmethod
    def backward(ctx, grad):
        (inv,) = ctx.saved_tensors
        return grad.index_select(2, inv), None, None


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() != 4 or t.stride(-1) == 1 else t.contiguous()


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: BlockTable,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of q over k, v restricted by a block-causal ``table``; returns [B, Hq, S, D].

    q: [B, Hq, S, D]; k, v: [B, Hkv, S, D] with Hq % Hkv == 0 (GQA, K/V never repeated);
    float32, bfloat16 or float16; differentiable in q, k, v. ``scale`` defaults to D**-0.5.
    """
    _ops.check_attention_inputs(q, k, v)
    if q.shape[2] != table.seq_len:
        raise ValueError(
            f"q, k, v have seq_len {q.shape[2]} but the block table covers {table.seq_len} tokens; "
            "build the table for this sequence"
        )
    if scale is None:
        scale = q.shape[-1] ** -0.5
    table = table.to(q.device)
    out, _ = ops.block_attention_fwd(
        _unit_last_stride(q),
        _unit_last_stride(k),
        _unit_last_stride(v),
        *table.tensors(),
        float(scale),
    )
    return out


@torch.compiler.disable
def _stream_plan(layout: JacobiLayout, device: torch.device):
    # Host-side bookkeeping (a few small int tensors, cached on the layout): kept out of
    # torch.compile graphs, whose tensors it only feeds as inputs.
    return layout.stream_plan(device)


def jacobi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: JacobiLayout,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over a packed Jacobi Forcing sequence with the layout's mask (SPEC §4).

    q: [B, Hq, S, D]; k, v: [B, Hkv, S, D]; Hq % Hkv == 0; S == layout.seq_len.
    Returns [B, Hq, S, D] in the packed order; differentiable in q, k, v.
    """
    _ops.check_attention_inputs(q, k, v)
    if q.shape[2] != layout.seq_len:
        raise ValueError(
            f"q, k, v have seq_len {q.shape[2]} but {layout} describes "
            f"P + 2*T*n = {layout.seq_len} tokens; pass the layout of this packed sequence"
        )
    table, perm, inv = _stream_plan(layout, q.device)
    qs, ks, vs = (_PermuteTokens.apply(x, perm, inv) for x in (q, k, v))
    out = block_attention(qs, ks, vs, table, scale)
    return _PermuteTokens.apply(out, inv, perm)
