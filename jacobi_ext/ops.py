"""The Python side of the torch.ops.jacobi_ext operators: fake (meta) kernels and autograd.

Schemas live in csrc/torch/module.cpp; the CPU and CUDA kernels register there under the same
names. Fake kernels let every op trace under torch.compile / torch.export; the attention forward
gets its backward through ``torch.library.register_autograd``.
"""

from __future__ import annotations

import torch

from ._native import ops

_ATTN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The shape/dtype/device rules of block attention (the C++ checks say the same)."""
    for name, t, heads in (("q", q, "q_heads"), ("k", k, "kv_heads"), ("v", v, "kv_heads")):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, {heads}, seq_len, head_dim], "
                f"got shape {tuple(t.shape)}"
            )
    if q.dtype not in _ATTN_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have dtype {q.dtype} (like q), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device} but q is on {q.device}; move them to one device"
            )
    B, Hq, S, D = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(
            f"k and v must be [batch={B}, kv_heads, seq_len={S}, head_dim={D}] to match q, "
            f"got {tuple(k.shape)}"
        )
    Hkv = k.shape[1]
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(
            f"the number of query heads ({Hq}) must be a multiple of the number of "
            f"key/value heads ({Hkv})"
        )
    if not 1 <= D <= 256:
        raise ValueError(f"head_dim must be in [1, 256], got {D}")


@torch.library.register_fake("jacobi_ext::block_attention_fwd")
def _block_attention_fwd_fake(q, k, v, block_start, kv_ptr, kv_idx, scale):
    check_attention_inputs(q, k, v)
    out = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    return out, lse


@torch.library.register_fake("jacobi_ext::block_attention_bwd")
def _block_attention_bwd_fake(
    grad_out, q, k, v, out, lse, block_start, kv_ptr, kv_idx, scale, deterministic
):
    check_attention_inputs(q, k, v)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("jacobi_ext::jf_block_table")
def _jf_block_table_fake(prompt_len, block_size, num_pairs, variant, window):
    nb = (1 if prompt_len > 0 else 0) + 2 * num_pairs
    # The number of visible block pairs depends on the values: a data-dependent size.
    nnz = torch.library.get_ctx().new_dynamic_size()
    i32 = torch.int32
    return (
        torch.empty(nb + 1, dtype=i32),
        torch.empty(nb + 1, dtype=i32),
        torch.empty(nnz, dtype=i32),
    )


def _attn_setup_context(ctx, inputs, output):
    q, k, v, block_start, kv_ptr, kv_idx, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, block_start, kv_ptr, kv_idx)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


def _attn_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, block_start, kv_ptr, kv_idx = ctx.saved_tensors
    if grad_out.dim() == 4 and grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dq, dk, dv = ops.block_attention_bwd(
        grad_out, q, k, v, out, lse, block_start, kv_ptr, kv_idx, ctx.scale, True
    )
    return dq, dk, dv, None, None, None, None


torch.library.register_autograd(
    "jacobi_ext::block_attention_fwd", _attn_backward, setup_context=_attn_setup_context
)
