"""The Python side of the torch.ops.jacobi_ext operators: fake (meta) kernels and autograd.

Schemas live in csrc/torch/module.cpp; the CPU and CUDA kernels register there under the same
names. Fake kernels let every op trace under torch.compile / torch.export; the attention forward
gets its backward through ``torch.library.register_autograd``.
"""

from __future__ import annotations

import functools

import torch

from ._native import ops

_ATTN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.bfloat16, torch.float16)

#: Head dims with compiled CUDA kernels (csrc/cuda/attention/attention_cuda.h says the same).
CUDA_HEAD_DIMS = (64, 96, 128, 256)
#: Head dims that ``block_attention`` / ``jacobi_attention`` run on CUDA through FlexAttention
#: when there is no compiled kernel for them (one warning per head dim).
CUDA_FLEX_HEAD_DIMS = range(32, 257)
_CUDA_MAX_GRID_Y = 65535  # batch * heads is the kernels' gridDim.y


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    allow_fallback: bool = False,
    kernel_rules: bool = True,
) -> bool:
    """The shape/dtype/device/stride rules of block attention, checked on metadata only (works on
    meta and fake tensors, never touches data or the device). The C++ ops check the same again.

    Returns True when the compiled kernel of q's device takes the inputs. With
    ``allow_fallback`` (the Python front end), a CUDA head dim without a compiled kernel but
    inside ``CUDA_FLEX_HEAD_DIMS`` returns False (run FlexAttention) instead of raising.
    Raises ValueError, saying what is expected, for everything else. ``kernel_rules=False``
    checks only what every backend needs (shapes, dtypes, devices), not the rules of a compiled
    kernel (CUDA dtypes, head dims, strides): the backends that run through torch's own attention
    (``streams``, ``flex``) take those inputs as they are.
    """
    for name, t, heads in (("q", q, "q_heads"), ("k", k, "kv_heads"), ("v", v, "kv_heads")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, {heads}, seq_len, head_dim], "
                f"got shape {tuple(t.shape)}"
            )
    for name, t in (("k", k), ("v", v)):
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device} but q is on {q.device}; move them to one device"
            )
    if q.dtype not in _ATTN_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have dtype {q.dtype} (like q), got {t.dtype}")
    cuda = q.device.type == "cuda" and kernel_rules
    if cuda and q.dtype not in _CUDA_DTYPES:
        raise ValueError(
            f"the CUDA attention takes bfloat16 or float16 q/k/v, got {q.dtype}; cast them "
            "(e.g. q.to(torch.bfloat16)) or run on CPU for float32"
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
            f"key/value heads ({Hkv}) (grouped-query attention: each k/v head serves "
            "q_heads / kv_heads query heads); check the head counts and the [B, H, S, D] layout"
        )
    if not 1 <= D <= 256:
        raise ValueError(f"head_dim must be in [1, 256], got {D}")
    if S >= 1 << 30:
        raise ValueError(f"seq_len must be < 2**30, got {S}")
    if not kernel_rules:
        return True
    if not cuda:
        # The CPU kernel reads every row as a GEMM operand: unit stride along head_dim.
        for name, t in (("q", q), ("k", k), ("v", v)):
            if D > 1 and t.stride(3) != 1:
                raise ValueError(
                    f"{name} must be contiguous in its last dim (head_dim), got strides "
                    f"{tuple(t.stride())}; call .contiguous()"
                )
        return True
    # CUDA: other strides are fine (the op copies rows that are not 16-byte aligned).
    if B * Hq > _CUDA_MAX_GRID_Y:
        raise ValueError(
            f"batch * query heads ({B} * {Hq}) must be at most {_CUDA_MAX_GRID_Y} on CUDA; "
            "split the batch"
        )
    if D in CUDA_HEAD_DIMS:
        return True
    if allow_fallback and D in CUDA_FLEX_HEAD_DIMS:
        return False
    where = (
        f"block_attention/jacobi_attention run head dims {CUDA_FLEX_HEAD_DIMS.start}.."
        f"{CUDA_FLEX_HEAD_DIMS.stop - 1} without a kernel through FlexAttention"
    )
    raise ValueError(
        f"head dim {D} has no CUDA kernel (compiled: {', '.join(map(str, CUDA_HEAD_DIMS))}); "
        f"{where}; otherwise pad the head dim to a supported one or run on CPU"
    )


def check_block_table_tensors(
    q: torch.Tensor, block_start: torch.Tensor, kv_ptr: torch.Tensor, kv_idx: torch.Tensor
) -> None:
    """Metadata rules of the table tensors (the values are checked by the CPU op; the CUDA op
    does not read them on the host)."""
    for name, t in (("block_start", block_start), ("kv_ptr", kv_ptr), ("kv_idx", kv_idx)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor (block table)")
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must have dtype torch.int32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device} but q is on {q.device}; move the block table to "
                "q's device (BlockTable.to(device))"
            )
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous())")
    if block_start.numel() < 1 or kv_ptr.numel() != block_start.numel():
        raise ValueError(
            "block_start and kv_ptr must both have num_blocks + 1 entries, got "
            f"{block_start.numel()} and {kv_ptr.numel()}"
        )


def check_attention_bwd_inputs(grad_out, q, k, v, out, lse) -> None:
    """The backward's extra arguments: grad_out and out shaped like q, lse [B, Hq, S] float32."""
    check_attention_inputs(q, k, v)
    for name, t in (("grad_out", grad_out), ("out", out)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have dtype {q.dtype} (like q), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if lse.shape != q.shape[:3]:
        raise ValueError(f"lse must be [B, Hq, S] = {tuple(q.shape[:3])}, got {tuple(lse.shape)}")
    if lse.dtype != torch.float32:
        raise ValueError(f"lse must have dtype torch.float32, got {lse.dtype}")
    if lse.device != q.device:
        raise ValueError(f"lse is on {lse.device} but q is on {q.device}")


@torch.library.register_fake("jacobi_ext::block_attention_fwd")
def _block_attention_fwd_fake(
    q, k, v, block_start, kv_ptr, kv_idx, scale, kernel=None, tile_lists=None
):
    check_attention_inputs(q, k, v)
    check_block_table_tensors(q, block_start, kv_ptr, kv_idx)
    out = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    return out, lse


@torch.library.register_fake("jacobi_ext::block_attention_bwd")
def _block_attention_bwd_fake(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    block_start,
    kv_ptr,
    kv_idx,
    scale,
    deterministic,
    kernel=None,
    tile_lists=None,
):
    check_attention_bwd_inputs(grad_out, q, k, v, out, lse)
    check_block_table_tensors(q, block_start, kv_ptr, kv_idx)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("jacobi_ext::block_attention_ordered_fwd")
def _block_attention_ordered_fwd_fake(q, k, v, block_start, kv_ptr, kv_idx, block_row, scale):
    return _block_attention_fwd_fake(q, k, v, block_start, kv_ptr, kv_idx, scale)


@torch.library.register_fake("jacobi_ext::block_attention_ordered_bwd")
def _block_attention_ordered_bwd_fake(
    grad_out, q, k, v, out, lse, block_start, kv_ptr, kv_idx, block_row, scale, deterministic
):
    return _block_attention_bwd_fake(
        grad_out, q, k, v, out, lse, block_start, kv_ptr, kv_idx, scale, deterministic
    )


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


@torch.library.register_fake("jacobi_ext::verify_step")
def _verify_step_fake(
    tokens, greedy, row_len, block_ends, init_tokens, pool, pool_len, pool_head, spawn, eos
):
    # One sequence ([rows, width] tokens, ...) or a batch (a leading [batch] everywhere): the
    # outputs' shapes follow the inputs' (csrc/include/jacobi/verify.h), whatever the values.
    lead = tuple(tokens.shape[:-2])
    R, W = tokens.shape[-2:]
    K, n, p = block_ends.shape[-1], init_tokens.shape[-1], pool.shape[-2]
    i32 = torch.int32
    return (
        tokens.new_empty(lead + (R,), dtype=i32),
        tokens.new_empty(lead + (8,)),
        tokens.new_empty(lead + (W,)),
        tokens.new_empty(lead + (W + n,)),
        tokens.new_empty(lead + (K,), dtype=i32),
        tokens.new_empty(lead + (p, n)),
        tokens.new_empty(lead + (p,), dtype=i32),
    )


@torch.library.register_fake("jacobi_ext::gumbel_argmax")
def _gumbel_argmax_fake(logits, keys, positions, temperature, top_k, top_p, min_p):
    # One token per row of logits [batch, positions, vocab] (csrc/include/jacobi/sampling.h).
    return positions.new_empty(tuple(logits.shape[:2]))


@torch.library.register_fake("jacobi_ext::debug_gumbel_noise")
def _debug_gumbel_noise_fake(keys, positions, vocab, uniform):
    return positions.new_empty(tuple(positions.shape) + (vocab,), dtype=torch.float64)


# ---- the CPU step's bookkeeping (csrc/torch/decode_ops.cpp, verify_ops.cpp, sampling_ops.cpp) ---
# Fakes so that a traced step (torch.compile, as CUDA graphs need it) keeps these ops in its graph.


@torch.library.register_fake("jacobi_ext::argmax")
def _argmax_fake(logits):
    return logits.new_empty(tuple(logits.shape[:-1]), dtype=torch.long)


@torch.library.register_fake("jacobi_ext::cpu_step_mask")
def _cpu_step_mask_fake(seg, off, lo, hi, width):
    B, Q = seg.shape
    return seg.new_empty((B, 1, Q, width), dtype=torch.bool)


# ---- the decode step's fused ops (csrc/torch/decode_ops.cpp, decode_ops_cuda.cpp) ---------------
# Fakes for torch.compile and for meta tensors (the step's kernel count is taken on meta tensors).


@torch.library.register_fake("jacobi_ext::rms_norm")
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


@torch.library.register_fake("jacobi_ext::fused_add_rms_norm")
def _fused_add_rms_norm_fake(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.register_fake("jacobi_ext::qk_rms_norm_")
def _qk_rms_norm_fake(qkv, heads, kv_heads, q_weight, k_weight, eps):
    return None


@torch.library.register_fake("jacobi_ext::silu_and_mul")
def _silu_and_mul_fake(gu):
    return gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))


@torch.library.register_fake("jacobi_ext::kv_commit")
def _kv_commit_fake(caches, src, dst, count, transposed):
    return None


@torch.library.register_fake("jacobi_ext::rope_attention")
def _rope_attention_fake(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, seg, off, lo,
                                hi, scale):  # fmt: skip
    B, Q = qkv.shape[:2]
    return qkv.new_empty((B, Q, heads, k_cache.shape[-1]))


@torch.library.register_fake("jacobi_ext::cpu_rope_attention")
def _cpu_rope_attention_fake(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots, attend,
                             mask, scale, kt_cache=None, context_start=0):  # fmt: skip
    B, Q = qkv.shape[:2]
    return qkv.new_empty((B, Q, heads, k_cache.shape[-1]))


@torch.library.register_fake("jacobi_ext::cpu_decode_attention")
def _cpu_decode_attention_fake(q, k, v, mask, scale):
    B, Hq, Q, D = q.shape  # out [B, Q, Hq, D]
    return q.new_empty((B, Q, Hq, D))


# The out= forms (module.cpp: "*.out"): the functional op's checks, then the size, dtype and
# layout the C++ side asks of each output (not resized: any shape of the result's size).
def _out(out: torch.Tensor, like: torch.Tensor, name: str = "out") -> torch.Tensor:
    if out.dtype != like.dtype or out.numel() != like.numel() or not out.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {like.dtype} tensor of {like.numel()} elements, got "
            f"{out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )
    return out


@torch.library.register_fake("jacobi_ext::fused_add_rms_norm.out")
def _fused_add_rms_norm_out_fake(x, residual, weight, eps, *, h, y):
    h_like, y_like = _fused_add_rms_norm_fake(x, residual, weight, eps)
    return _out(h, h_like, "h"), _out(y, y_like, "y")


@torch.library.register_fake("jacobi_ext::silu_and_mul.out")
def _silu_and_mul_out_fake(gu, *, out):
    return _out(out, _silu_and_mul_fake(gu))


@torch.library.register_fake("jacobi_ext::cpu_rope_attention.out")
def _cpu_rope_attention_out_fake(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots, attend,
                                 mask, scale, kt_cache=None, context_start=0, *, out):  # fmt: skip
    like = _cpu_rope_attention_fake(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots,
                                    attend, mask, scale, kt_cache, context_start)  # fmt: skip
    return _out(out, like)


@torch.library.register_fake("jacobi_ext::verify_rows")
def _verify_rows_fake(toks, tgt, row_start, row_len, init_idx, src, block_ends, pool,
                          pool_len, pool_head, ctx, ctx_len, spawn, eos, width):  # fmt: skip
    B, R, n = toks.shape[0], row_len.shape[1], init_idx.shape[1]
    K, p = block_ends.shape[1], pool.shape[1]
    L = torch.ops.jacobi_ext.step_row_layout(width, K, p, R, n)[-1]  # (jacobi/step_row.h)
    return (
        toks.new_empty((B, L)),
        toks.new_empty((B,)),
        toks.new_empty((B,)),
        toks.new_empty((B,), dtype=torch.bool),
    )


@torch.library.register_fake("jacobi_ext::ar_accept")
def _ar_accept_fake(toks, tgt, fed, eos, width, tail):
    B = toks.shape[0]
    L = torch.ops.jacobi_ext.step_row_layout(width, 0, 0, 0, 0)[-1] + tail  # (jacobi/step_row.h)
    return toks.new_empty((B, L)), toks.new_empty((B,))


# ---- the CPU decode-shaped linear (csrc/cpu/linear_cpu.h) ---------------------------------------
_LINEAR_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def cpu_linear_layout(dtype: torch.dtype) -> tuple[str, int]:
    """(pack format, NR) of the CPU linear kernel of this process for a weight dtype, as
    ``cpu_linear_info`` names them ("avx512 bf16_pairs NR=32" -> ("bf16_pairs", 32)). Both are
    fixed once per process (the ISA is chosen at start), so the answer is cached."""
    _isa, fmt, nr = ops.cpu_linear_info(dtype).split()
    return fmt, int(nr.removeprefix("NR="))


def cpu_linear_packed_shape(dtype: torch.dtype, N, K) -> tuple:
    """The shape ``cpu_linear_pack`` gives an [N, K] weight on this CPU: [ceil(N / NR), k_rows,
    NR], k_rows = K, or K rounded up to even for the bf16 pairs of AVX512-BF16."""
    fmt, nr = cpu_linear_layout(dtype)
    k_rows = (K + 1) // 2 * 2 if fmt == "bf16_pairs" else K
    return ((N + nr - 1) // nr, k_rows, nr)


def cpu_pack_panels(w: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
    """A weight [N, K] in panels of `width` outputs, [ceil(N / width), K, width] of `dtype` (rows
    past N zero): with width NR and float32, what ``cpu_linear_pack`` gives."""
    N, K = w.shape
    panels = -(-N // width)
    out = torch.zeros(panels * width, K, dtype=dtype)
    out[:N] = w.to(dtype)
    return out.view(panels, width, K).transpose(1, 2).contiguous()


def cpu_lora_pack_a(a: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A LoRA's A factor [rows, K] (rows: the rank, or several linears' ranks stacked) as
    ``cpu_linear_gguf``'s ``lora_a``: panels one vector wide, [ceil(rows / VL), K, VL] of `dtype`
    (float32 or bfloat16; rows past the end zero), VL = NR / 2. Why not ``cpu_linear_pack``'s
    NR-wide panels: a rank-16 A in 32-wide panels (AVX-512) is half zeros, read at every call."""
    if a.dim() != 2:
        raise ValueError(f"a must be 2-D [rank, in_features], got shape {tuple(a.shape)}")
    _check_linear_dtype(dtype, "dtype")
    return cpu_pack_panels(a, dtype, cpu_linear_layout(torch.float32)[1] // 2)


def _check_linear_dtype(dtype: torch.dtype, name: str) -> None:
    if dtype not in _LINEAR_DTYPES:
        raise ValueError(
            f"{name} must be float32 or bfloat16 (the CPU linear kernel's dtypes), got {dtype}; "
            "other dtypes run through torch.nn.functional.linear"
        )


@torch.library.register_fake("jacobi_ext::cpu_linear_pack_cat")
def _cpu_linear_pack_cat_fake(weights):
    if not weights:
        raise ValueError("cpu_linear_pack_cat needs at least one weight")
    first = weights[0]
    for i, w in enumerate(weights):
        name = "weight" if len(weights) == 1 else f"weights[{i}]"
        if w.dim() != 2:
            raise ValueError(
                f"{name} must be 2-D [out_features, in_features], got shape {tuple(w.shape)}"
            )
        _check_linear_dtype(w.dtype, name)
        if w.dtype != first.dtype:
            raise ValueError(f"{name} has dtype {w.dtype}, weights[0] {first.dtype}")
        if w.shape[1] != first.shape[1]:
            raise ValueError(
                f"{name} has {w.shape[1]} input features, weights[0] has {first.shape[1]}"
            )
    N = sum(w.shape[0] for w in weights)
    return first.new_empty(cpu_linear_packed_shape(first.dtype, N, first.shape[1]))


@torch.library.register_fake("jacobi_ext::cpu_linear_pack")
def _cpu_linear_pack_fake(weight):
    return _cpu_linear_pack_cat_fake([weight])


@torch.library.register_fake("jacobi_ext::cpu_linear")
def _cpu_linear_fake(x, packed, out_features, bias=None):
    # The checks of csrc/torch/linear_ops.cpp on metadata; y is x's shape with N last, x's dtype.
    if x.dim() < 1:
        raise ValueError("x must be [..., in_features], got a 0-d tensor")
    _check_linear_dtype(x.dtype, "x")
    if packed.dtype != x.dtype:
        raise ValueError(
            f"packed has dtype {packed.dtype} but x has {x.dtype}; pack the weight in x's dtype"
        )
    if not packed.is_contiguous():
        raise ValueError("packed must be contiguous (call .contiguous())")
    N, K = out_features, x.shape[-1]
    if N < 0:
        raise ValueError(f"out_features must be >= 0, got {N}")
    want = cpu_linear_packed_shape(x.dtype, N, K)
    if tuple(packed.shape) != want:
        raise ValueError(
            f"packed has shape {tuple(packed.shape)} but a {N} x {K} weight packs to {want} on "
            "this CPU: pack it with cpu_linear_pack(weight) in this process, for this x"
        )
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != N:
            raise ValueError(f"bias must be [out_features={N}], got shape {tuple(bias.shape)}")
        if bias.dtype not in (torch.float32, x.dtype):
            raise ValueError(f"bias must be float32 or x's dtype ({x.dtype}), got {bias.dtype}")
    return x.new_empty((*x.shape[:-1], N))


@torch.library.register_fake("jacobi_ext::cpu_linear.out")
def _cpu_linear_out_fake(x, packed, out_features, bias=None, *, out):
    return _out(out, _cpu_linear_fake(x, packed, out_features, bias))


# The GGUF linear's formats (csrc/cpu/linear_gguf_cpu.h, gguf_format): ggml type id ->
# (weights per file block, bytes per file block, k per packed group, header bytes per column,
# code bits).
GGUF_FORMATS = {
    2: (32, 18, 32, 2, 4),  # Q4_0
    3: (32, 20, 32, 4, 4),  # Q4_1
    8: (32, 34, 32, 2, 8),  # Q8_0
    12: (256, 144, 32, 8, 4),  # Q4_K
    13: (256, 176, 32, 8, 8),  # Q5_K
    14: (256, 210, 16, 4, 8),  # Q6_K
}
# ggml's type ids -> names, for the types the kernels read.
GGUF_TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


@functools.cache
def gguf_kernel_types() -> tuple[int, ...]:
    """The ggml type ids this build's CPU kernels read (empty without the compiled op)."""
    if not hasattr(ops, "cpu_linear_gguf_types"):
        return ()
    return tuple(int(t) for t in ops.cpu_linear_gguf_types())


def gguf_kernel_type_names() -> list[str]:
    """`gguf_kernel_types()` by name ("Q4_0", ...); needs no numpy, so `build_info` can say it."""
    return [GGUF_TYPE_NAMES.get(t, str(t)) for t in gguf_kernel_types()]


def cpu_linear_gguf_packed_shape(ggml_type: int, N, K) -> tuple:
    """The shape ``cpu_linear_gguf_pack`` gives N rows of K weights of a ggml type on this CPU:
    [ceil(N / NR), K / G, NR * header bytes + NR * G * code bits / 8] bytes."""
    if ggml_type not in GGUF_FORMATS:
        raise ValueError(f"ggml type {ggml_type} is not read by the GGUF linear kernels")
    _bk, _bb, g, header, bits = GGUF_FORMATS[ggml_type]
    _fmt, nr = cpu_linear_layout(torch.float32)
    return (-(-N // nr), K // g, nr * header + nr * g * bits // 8)


@torch.library.register_fake("jacobi_ext::cpu_linear_gguf_pack")
def _cpu_linear_gguf_pack_fake(weights, type):
    if not weights:
        raise ValueError("cpu_linear_gguf_pack needs at least one weight")
    if type not in GGUF_FORMATS:
        raise ValueError(f"ggml type {type} is not read by the GGUF linear kernels")
    bk, bb = GGUF_FORMATS[type][:2]
    N = sum(w.shape[0] for w in weights)
    K = weights[0].shape[1] // bb * bk
    return weights[0].new_empty(cpu_linear_gguf_packed_shape(type, N, K))


@torch.library.register_fake("jacobi_ext::cpu_weight_arena")
def _cpu_weight_arena_fake(nbytes):
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return torch.empty(nbytes, dtype=torch.uint8)


@torch.library.register_fake("jacobi_ext::cpu_linear_gguf")
def _cpu_linear_gguf_fake(
    x, packed, type, out_features, bias=None, lora_a=None, lora_b=None, lora_panel_r0=None,
    int8_activations=False,
):  # fmt: skip
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32 (the GGUF linear computes in float32), got {x.dtype}")
    want = cpu_linear_gguf_packed_shape(type, out_features, x.shape[-1])
    if tuple(packed.shape) != want:
        raise ValueError(f"packed has shape {tuple(packed.shape)}, expected {want}")
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.register_fake("jacobi_ext::cpu_linear_gguf.out")
def _cpu_linear_gguf_out_fake(
    x, packed, type, out_features, bias=None, lora_a=None, lora_b=None, lora_panel_r0=None,
    int8_activations=False, *, out,
):  # fmt: skip
    like = _cpu_linear_gguf_fake(x, packed, type, out_features, bias, lora_a, lora_b,
                                 lora_panel_r0, int8_activations)  # fmt: skip
    return _out(out, like)


@torch.library.register_fake("jacobi_ext::cpu_linear_gguf_abs_sums")
def _cpu_linear_gguf_abs_sums_fake(packed, type, out_features, in_features):
    return packed.new_empty((out_features + 1,), dtype=torch.float32)


@torch.library.register_fake("jacobi_ext::cpu_linear_gguf_greedy")
def _cpu_linear_gguf_greedy_fake(x, packed, type, out_features, abs_sums):
    want = cpu_linear_gguf_packed_shape(type, out_features, x.shape[-1])
    if tuple(packed.shape) != want:
        raise ValueError(f"packed has shape {tuple(packed.shape)}, expected {want}")
    return x.new_empty(tuple(x.shape[:-1]), dtype=torch.long)


@torch.library.register_fake("jacobi_ext::cpu_gguf_q8_0_rows")
def _cpu_gguf_q8_0_rows_fake(raw, ids):
    if raw.dim() != 2 or raw.shape[1] % 34:
        raise ValueError(f"raw must be [rows, blocks * 34] Q8_0 blocks, got {tuple(raw.shape)}")
    return raw.new_empty((*ids.shape, raw.shape[1] // 34 * 32), dtype=torch.float32)


#: The portable kernel of each device type: what block_attention_fwd/bwd run for kernel=None or
#: "auto" (the ops never read the environment: jacobi_ext/kernels/attention.py decides the rest).
PORTABLE_KERNELS = {"cpu": "cpu", "cuda": "sm80"}


def _attn_setup_context(ctx, inputs, output):
    q, k, v, block_start, kv_ptr, kv_idx, scale, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, block_start, kv_ptr, kv_idx)
    ctx.scale = scale
    # The backward is passed the kernel the forward was, by name (_attn_backward says which
    # backward runs; None / "auto" name the device's portable kernel, which the forward ran),
    # with the forward's tile lists (rest[1]: int32 lists built once per table; without them the
    # sm_90a backward would rebuild them from a host copy of the table at every call).
    kernel = rest[0] if rest else None
    if kernel in (None, "auto"):
        kernel = PORTABLE_KERNELS.get(q.device.type, kernel)
    ctx.kernel = kernel
    ctx.tile_lists = rest[1] if len(rest) > 1 else None
    ctx.mark_non_differentiable(lse)


def _deterministic_backward(q, kernel) -> bool:
    """Whether autograd asks the op for a deterministic backward. The CPU backward always is, and
    on CUDA the sm_80 backward runs its deterministic form. The sm_90a kernel, where it runs
    (the forward was passed "sm90": backend "sm90", JACOBI_ATTN_KERNEL=sm90, or a default that
    picks it, jacobi_ext/kernels/attention.py) and has a backward for the dtype and head dim, runs
    that backward with its dQ sums added in any order (faster; docs/sm90_attention.md), unless torch
    was told to use deterministic algorithms (``torch.use_deterministic_algorithms(True)``): then
    the same backward adds each query tile's sums in key-tile order. Under torch.compile the
    choice is not traced (the op names a kernel with a string): the deterministic one."""
    if q.device.type != "cuda" or torch.are_deterministic_algorithms_enabled():
        return True
    if torch.compiler.is_compiling():
        return True
    return ops.attention_bwd_kernel(q, False, kernel) != "sm90"


def _attn_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, block_start, kv_ptr, kv_idx = ctx.saved_tensors
    if grad_out.dim() == 4 and grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dq, dk, dv = ops.block_attention_bwd(
        grad_out, q, k, v, out, lse, block_start, kv_ptr, kv_idx, ctx.scale,
        _deterministic_backward(q, ctx.kernel), ctx.kernel, ctx.tile_lists,
    )  # fmt: skip
    # One entry per argument as the caller passed them (the op has a Tensor[] argument, so torch
    # checks the structure: a list of tile-list tensors gets a list of Nones).
    rest = [
        [None] * len(x) if isinstance(x, list | tuple) else None for x in ctx.needs_input_grad[3:]
    ]
    return (dq, dk, dv, *rest)


torch.library.register_autograd(
    "jacobi_ext::block_attention_fwd", _attn_backward, setup_context=_attn_setup_context
)


def _ordered_setup_context(ctx, inputs, output):
    q, k, v, block_start, kv_ptr, kv_idx, block_row, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, block_start, kv_ptr, kv_idx, block_row)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


def _ordered_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, block_start, kv_ptr, kv_idx, block_row = ctx.saved_tensors
    if grad_out.dim() == 4 and grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dq, dk, dv = ops.block_attention_ordered_bwd(
        grad_out, q, k, v, out, lse, block_start, kv_ptr, kv_idx, block_row, ctx.scale, True
    )
    return dq, dk, dv, None, None, None, None, None


torch.library.register_autograd(
    "jacobi_ext::block_attention_ordered_fwd",
    _ordered_backward,
    setup_context=_ordered_setup_context,
)


def has_kernel(op: str, device: torch.device) -> bool:
    """Whether torch.ops.jacobi_ext.<op> has a kernel for this device type (CPU / CUDA)."""
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device.type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"jacobi_ext::{op}", key
    )
