"""The executors of one forward: one program (lean.LeanDecoder: the family's layers declared
once as LayerPlans, the embedding, the rotary rows, the LM head) run by one of three executors
over the same StepView (masks.py: the step plan, where the K/V go, what may be seen).

    runtime (StepView) -> program (embed, rotary rows) -> executor (layers) -> program (head)

  - REFERENCE: the model's own modules' forwards (norms, rotary, attention function) over our
    packed linears and cache; any dtype, the family's pieces as transformers runs them, bitwise
    transformers' forward over these linears. Reads a mask (StepView.mask, then the attention
    function's format).
  - CPU: our fused CPU ops (csrc/cpu/decode_cpu.h), the layers in one native call
    (LeanLayers, csrc/torch/lean_ops.cpp) where the program built it, else the same ops in the
    same order from Python. Reads the bool mask (StepView.mask).
  - CUDA: our CUDA twins of those ops (csrc/cuda/decode_cuda.cu) and an attention that reads
    the step plan itself on the device: no mask. A forward without a plan (a one-pass
    prefill) runs REFERENCE.
Each executor returns the normed hidden states the head reads; the program picks one at each
refresh (options.py: JACOBI_EXT_FUSED=0 picks REFERENCE). What an executor needs of a layer is
its LayerPlan (lean.py), the same for all three.
"""

from __future__ import annotations

import torch

from .masks import StepView, for_backend


class Executor:
    """One way to run the program's layers (see the module docstring)."""

    name = ""
    reads_plan = False  # its attention reads StepView.plan itself (else StepView.mask())
    # whether a one-sequence step may write its K/V where they stay (runtime.writes_in_place):
    # an attention that sums a row's keys in position order wherever they sit
    writes_in_place = False

    def layers(self, dec, ids: torch.Tensor, pos: torch.Tensor, view: StepView,
               rt) -> torch.Tensor:  # fmt: skip
        """The normed hidden states [B, Q, hidden] of tokens ids [B, Q] at positions pos, their
        K/V written where `view` says into the runtime rt's cache."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<executor {self.name}>"


class _Reference(Executor):
    name = "reference"

    def layers(self, dec, ids, pos, view, rt):
        mask = for_backend(dec.model, view.mask(), rt.dtype)
        inner = dec.inner
        h = inner.embed_tokens.forward(ids)
        cos, sin = inner.rotary_emb.forward(h, pos)
        B, Q = ids.shape
        for i, L in enumerate(dec.layers):
            a = L.attn
            residual = h
            x = dec._norm(L.ln1, h)
            q, k, v = L.qkv(x).split(L.splits, dim=-1)
            q, k = q.view(B, Q, -1, a.head_dim), k.view(B, Q, -1, a.head_dim)
            if L.q_norm is not None:  # (Qwen3: per head, before the rotary)
                q, k = dec._norm(L.q_norm, q), dec._norm(L.k_norm, k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.view(B, Q, -1, a.head_dim).transpose(1, 2)
            q, k = dec.rotary(q, k, cos, sin)
            k, v = rt.cache.layers[i].update(k, v)  # (SlotLayer: at the view's slots)
            out, _ = dec.attention(a, q, k, v, mask, dropout=0.0, scaling=a.scaling)
            h = residual + L.o(out.reshape(B, Q, -1).contiguous())
            residual = h
            x = dec._norm(L.ln2, h)
            g, u = L.gate_up(x).split((L.mlp_split, L.mlp_split), dim=-1)
            h = residual + L.down(L.act(g) * u)
        return dec._norm(inner.norm, h)


class _Cpu(Executor):
    """Per layer eight calls (norm with the residual add, q/k/v, rotary + cache write +
    attention, o, norm, gate/up, silu * up, down), or all of them in one native call."""

    name = "cpu"
    writes_in_place = True

    def layers(self, dec, ids, pos, view, rt):
        ops = torch.ops.jacobi_ext
        mask = view.mask()
        h, cos, sin, x = _fused_inputs(dec, ids, pos, rt)
        B, Q = ids.shape
        # context in slots [scratch, width), the step's tokens in [0, scratch): sums by position
        slots, attend, ctx0 = view.slots, view.width, rt.scratch
        if dec.native is not None:
            kts, keys, values = cache_lists(rt.cache, dec.plans, h)
            return dec.native.run(x, h, cos, sin, keys, values, kts, slots, attend, mask, ctx0)
        rope_attention, add_rms_norm, silu_mul = (
            ops.cpu_rope_attention.default,
            ops.fused_add_rms_norm.default,
            ops.silu_and_mul.default,
        )
        qk_norm = ops.qk_rms_norm_.default
        for layer, plan in zip(rt.cache.layers, dec.plans, strict=False):
            qkv = plan.qkv_fn(x, *plan.qkv_args)
            if plan.qk_norm is not None:
                qk_norm(qkv, plan.heads, plan.kv_heads, *plan.qk_norm)
            kt = layer_cache(layer, plan, h)
            out = rope_attention(
                qkv, plan.heads, plan.kv_heads, cos, sin, layer.keys, layer.values, slots,
                attend, mask, plan.scaling, kt, ctx0,
            )  # fmt: skip
            h, x = after_attention(plan, out.view(B, Q, -1), h, add_rms_norm, silu_mul)
        return x


class _Cuda(Executor):
    """Per layer the add + RMSNorm, one q/k/v GEMM, rotary + K/V write + attention over the step
    plan (split-K and its combine), the o GEMM, add + RMSNorm, one gate/up GEMM, SiLU * up and the
    down GEMM: nine kernels (ten with a q/k/v bias), no host value read, fixed shapes: one CUDA
    graph a step."""

    name = "cuda"
    reads_plan = True

    def layers(self, dec, ids, pos, view, rt):
        ops = torch.ops.jacobi_ext
        plan = view.plan
        h, cos, sin, x = _fused_inputs(dec, ids, pos, rt)
        B, Q = ids.shape
        attention = ops.rope_attention.default
        add_rms_norm, silu_mul = ops.fused_add_rms_norm.default, ops.silu_and_mul.default
        qk_norm = ops.qk_rms_norm_.default
        for layer, p in zip(rt.cache.layers, dec.plans, strict=False):
            initialized(layer, p, h)  # (a prefill made them; a bare probe may not have)
            qkv = p.qkv_fn(x, *p.qkv_args)
            if p.qk_norm is not None:
                qk_norm(qkv, p.heads, p.kv_heads, *p.qk_norm)
            out = attention(
                qkv, p.heads, p.kv_heads, cos, sin, layer.keys, layer.values, plan.seg, plan.off,
                plan.lo, plan.hi, p.scaling,
            )  # fmt: skip
            h, x = after_attention(p, out.view(B, Q, -1), h, add_rms_norm, silu_mul)
        return x


REFERENCE, CPU, CUDA = _Reference(), _Cpu(), _Cuda()


def _fused_inputs(dec, ids: torch.Tensor, pos: torch.Tensor, rt):
    """What both fused executors start from: the embedded tokens h, the rotary rows cos, sin of
    their positions, and the first layer's normed input x."""
    h = dec.inner.embed_tokens.forward(ids)
    cos, sin = dec._cos_sin(h, pos, rt)
    first = dec.layers[0].ln1
    x = torch.ops.jacobi_ext.rms_norm(h, dec.norm_weight(first), first.variance_epsilon)
    return h, cos, sin, x


def after_attention(p, attn: torch.Tensor, h: torch.Tensor, add_rms_norm,
                    silu_mul) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A layer after its attention, as both fused executors run it: the o projection added to
    the residual and normed, gate/up, SiLU * up, the down projection added and normed by the next
    layer's norm. Returns (residual stream, normed input)."""
    h, x = add_rms_norm(p.o_fn(attn, *p.o_args), h, p.ln2_w, p.ln2_eps)
    gu = p.gu_fn(x, *p.gu_args)
    if p.act_layer is None:
        m = silu_mul(gu)
    else:  # an activation other than SiLU: the model's own
        L = p.act_layer
        g, u = gu.split((L.mlp_split, L.mlp_split), dim=-1)
        m = L.act(g) * u
    return add_rms_norm(p.down_fn(m, *p.down_args), h, p.norm_w, p.norm_eps)


def cache_lists(cache, plans, h: torch.Tensor) -> tuple[list, list, list]:
    """The native run's per-layer tensors of `cache`: transposed keys, keys, values. A runtime's
    cache keeps its buffers for its life (made at the first step), so the lists are made once
    and kept on it (made every step, ~30-40 us of a ~4 ms one-token step)."""
    layers = cache.layers[: len(plans)]
    kept = cache.__dict__.get("_jacobi_ext_lists")
    if kept is not None and kept[1][0] is layers[0].keys and kept[1][-1] is layers[-1].keys:
        return kept
    kts = [layer_cache(c, p, h) for c, p in zip(layers, plans, strict=True)]
    kept = (kts, [c.keys for c in layers], [c.values for c in layers])
    cache.__dict__["_jacobi_ext_lists"] = kept
    return kept


def initialized(layer, plan, h: torch.Tensor) -> None:
    """A runtime cache layer's K/V buffers, made on first use (in the runtime's K/V element
    type: SlotLayer)."""
    if not layer.is_initialized:
        kv = h.new_empty(h.shape[0], plan.kv_heads, 1, plan.head_dim)
        layer.lazy_initialization(kv, kv)


def layer_cache(layer, plan, h: torch.Tensor) -> torch.Tensor:
    """A runtime cache layer's blocked transposed keys, its buffers made on first use."""
    initialized(layer, plan, h)
    kt = getattr(layer, "keys_t", None)
    if kt is None:
        kt = layer.keys_t = keys_transposed(layer.keys)
    return kt


def keys_transposed(keys: torch.Tensor) -> torch.Tensor:
    """A cache layer's keys [B, H, capacity, D] kept transposed in blocks of 16 slots, float32
    (float16 for a half cache) [B, H, L / 16, D, 16] (L the capacity rounded up to 16):
    cpu_rope_attention writes each step's keys into it and attends from it, instead of
    transposing every attended key again at every step and layer (at a few hundred keys about
    half the attention's memory traffic).
    Blocks, not one [D, L] matrix: a block of 16 keys is 4 KB read in order (D = 64), where D rows
    a page apart left the prefetcher nothing to follow. kv_commit moves its slots with the
    cache's. Zeros at first: a slot is read only after this call wrote it."""
    B, H, cap, D = keys.shape
    dtype = torch.float16 if keys.dtype == torch.float16 else torch.float32
    return torch.zeros(B, H, -(-cap // 16), D, 16, dtype=dtype)
