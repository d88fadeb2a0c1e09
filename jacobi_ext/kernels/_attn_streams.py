"""The stream-order fast path of ``jacobi_attention`` (``backend="streams"``).

A ``noisy_context`` layout is exactly two causal streams that share the prompt: every noisy query
sees the prompt, the earlier noisy blocks and its own block causally, every clean query the
prompt, the earlier clean blocks and its own block causally (docs/method.md §1). So its
attention is two plain causal attentions over ``prompt ⊕ noisy blocks`` and ``prompt ⊕ clean
blocks``, which torch's SDPA runs with its best kernel (cuDNN or flash on CUDA): gather each stream,
two causal SDPA calls, scatter the outputs back to the packed order. Autograd gives the backward:
the prompt's keys and values collect gradients from both streams; the prompt's queries are computed
in both (square causal calls, so the fastest SDPA kernels apply) and the second copy is dropped,
which costs P^2/2 scores per head and changes nothing else.

Which layouts are two streams is decided from the block table (csrc/include/jacobi/block_table.h,
the one statement of the rule), not restated here: a layout qualifies when its table equals the
``noisy_context`` table of its shape (e.g. ``windowed`` with a window of every pair, or
``clean_context`` with one pair).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .layout import JacobiLayout


@functools.lru_cache(maxsize=256)
def is_two_stream(layout: JacobiLayout) -> bool:
    """True when ``layout``'s mask is the two causal streams of ``noisy_context``."""
    if layout.variant == "noisy_context":
        return True
    ref = JacobiLayout(layout.prompt_len, layout.block_size, layout.num_blocks, "noisy_context")
    return all(
        torch.equal(a, b)
        for a, b in zip(layout.block_table().tensors(), ref.block_table().tensors(), strict=True)
    )


def stream_indices(layout: JacobiLayout) -> tuple[torch.Tensor, ...]:
    """(noisy_idx, clean_idx, inv, order), LongTensors on the CPU: the packed positions of the
    tokens of ``prompt ⊕ noisy blocks`` and of ``prompt ⊕ clean blocks`` (stream order);
    ``order`` = cat(noisy_idx, clean_idx[P:]) (stream position -> packed position) and its
    inverse ``inv``, so that ``cat([noisy stream, clean stream minus its prompt])[..., inv, :]``
    is the packed order."""
    P, n, T = layout.prompt_len, layout.block_size, layout.num_blocks
    prompt = torch.arange(P)
    # Response offsets of the n tokens of block j of a stream: noisy_j at P + 2jn, clean_j n later.
    offs = (torch.arange(T)[:, None] * 2 * n + torch.arange(n)[None, :]).reshape(-1) + P
    noisy = torch.cat([prompt, offs])
    clean = torch.cat([prompt, offs + n])
    order = torch.cat([noisy, clean[P:]])  # stream position -> packed position
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    return noisy, clean, inv, order


class _PermuteTokens(torch.autograd.Function):
    """x.index_select(2, perm) whose backward is the gather by the inverse permutation
    (exact and cheap, where index_select's own backward would scatter-add into zeros). Used
    here and by ``attention`` (its ordered path on devices without an ordered kernel)."""

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


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient. The gradient of a stream's output
    arrives as a slice of the packed gradient (``cat``'s backward narrows along the tokens), and
    SDPA's CUDA backward kernels have read such strided gradients wrongly: on an H200 (torch
    2.11) this backend's dQ was off by 115-144 % against the float64 reference while
    its forward matched, and strided gradients into fused attention backwards are a known class of
    bugs (e.g. Dao-AILab/flash-attention#355). One copy of [B, Hq, L, D] per stream removes it."""

    @staticmethod
    def forward(x):
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@functools.lru_cache(maxsize=64)
def _indices_on(layout: JacobiLayout, device: str) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in stream_indices(layout))


@torch.compiler.disable
def _indices(layout: JacobiLayout, device: torch.device) -> tuple[torch.Tensor, ...]:
    # Host-side bookkeeping, cached per (layout, device), kept out of torch.compile graphs.
    return _indices_on(layout, str(device))


def streams_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: JacobiLayout,
    scale: float | None,
) -> torch.Tensor:
    """Two causal SDPA calls in stream order; q [B, Hq, S, D], k/v [B, Hkv, S, D] (GQA kept:
    SDPA's enable_gqa, k/v never repeated here). The caller has checked the layout and shapes."""
    P = layout.prompt_len
    noisy, clean, inv, order = _indices(layout, q.device)
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for idx in (noisy, clean):
        qs, ks, vs = (x.index_select(2, idx) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(_ContiguousGrad.apply(o))
    # Stream order [prompt, noisy blocks, clean blocks] back to the packed order.
    # A permutation: its backward is the gather by `order`, not index_select's scatter-add.
    out = torch.cat([outs[0], outs[1][:, :, P:]], dim=2)
    return _PermuteTokens.apply(out, inv, order)
