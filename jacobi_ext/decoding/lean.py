"""The step program: a model family's layers (models/families) declared once as LayerPlans,
with the embedding, the rotary rows and the LM head around them; its layers run by one of the
executors of executors.py (reference, cpu, cuda) over one masks.StepView. The same computation
as transformers' forward, with less Python around it and fewer, wider linears.

Why: with the linears at the memory roofline (prepack.py, our kernel), a one-token forward of
a small model spent about as long in transformers' Python (module calls, hooks, decorators, mask
preparation) as in reading the weights (docs/results/cpu-roofline-2026-11-27). This
forward walks the layers in one loop and calls the model's own pieces directly:
  - the model's own RMSNorm, rotary embedding, `apply_rotary_pos_emb`, activation and attention
    function (transformers' sdpa or eager one, chosen as the model's config says), through their
    `forward` functions, not the nn.Module call machinery (executors.REFERENCE);
  - the q, k, v projections as one linear and the gate and up projections as one, through our
    kernel from weights packed once (the same values: each output of the kernel is one fp32
    chain over the input features, whichever other rows or columns are computed beside it).
  - by default (in the runtime's cache), the rest of a layer through our fused CPU ops
    (csrc/cpu/decode_cpu.h): rotary + cache write + attention in one call, the residual add with
    the RMSNorm after it, SiLU times up. torch's SDPA cost ~55 us a call at one query row and
    ~120 us at 16 for a few hundred thousand FLOPs, an RMSNorm seven ATen ops, and each ATen op
    a few microseconds of dispatch: ~25 calls per layer become 8. Like the linear kernel, these
    ops compute each row alone, so a token's hidden state does not depend on how many tokens
    the step feeds (executors.CPU).
  - those ops for all layers in one call from Python (torch.classes.jacobi_ext.LeanLayers,
    csrc/torch/lean_ops.cpp: the same functions in the same order, so the same bits): the
    ~240 op calls of a step cost ~1 ms of a ~10 ms one-token step in Python and dispatch.
    JACOBI_EXT_NATIVE=0 calls them from Python.
With JACOBI_EXT_FUSED=0 (the model's own attention function and norms) its logits are bitwise
those of transformers' forward with our kernel behind every `nn.Linear`; with the fused ops they
agree to rounding (tests/test_lean_forward.py), and every decoding method returns exactly the
tokens of our AR either way.

Where it applies (`lean_decoder(model)`): a CPU model whose linears run on our kernel
(prepack.backend == "kernel"), of a class whose layers are exactly Llama's (Llama, Qwen2 and
Mistral without sliding windows; checked module by module), with sdpa or eager attention.
Anything else runs transformers' forward. JACOBI_EXT_LEAN=0 switches it off.

On CUDA (prepack.lean_backend == "cuda": a float32 / bfloat16 model of those classes, head dims
64 or 128, on a build with the CUDA decode ops) `CudaLeanDecoder` is the same program with torch
linears (cuBLAS) over weights concatenated once (q/k/v, gate/up), run by executors.CUDA: our CUDA
twins of the fused ops (csrc/cuda/decode_cuda.cu) and an attention that reads the step plan on
the device instead of a bool mask; nine kernels a layer, one CUDA graph a step
(docs/kernels.md).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
from torch import nn

from ..models.families import family_of, supported_classes
from ..models.quantized import GGUFEmbedding, GGUFLinear
from . import prepack
from .executors import CPU, CUDA, REFERENCE, cache_lists
from .linears import _CatLinear, _greedy_head, _GreedyHead, _Packed  # noqa: F401
from .masks import StepView
from .options import options

_ATTR = "_jacobi_ext_lean_decoder"
SUPPORTED = supported_classes()  # (jacobi_ext/models/families: Llama, Mistral, Qwen2, Qwen3)


def _linear(m) -> bool:
    """An nn.Linear, or a linear reading GGUF codes (jacobi_ext.models.quantized)."""
    return type(m) in (nn.Linear, GGUFLinear)


def _unsupported(model) -> str | None:
    """Why `model` cannot run the lean forward (None: it can)."""
    fam = family_of(model)
    if fam is None:
        return f"{type(model).__name__} is not one of {SUPPORTED}"
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} (sdpa or eager only)"
    inner = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"the model has no model.{name}"
    if not _linear(getattr(model, "lm_head", None)):
        return "lm_head is not an nn.Linear"
    if not (hasattr(inner.norm, "variance_epsilon") and hasattr(inner.norm, "weight")):
        return "the final norm is not Llama's RMSNorm"
    if type(inner.embed_tokens) not in (nn.Embedding, GGUFEmbedding):
        return "embed_tokens is not an nn.Embedding"
    for i, layer in enumerate(inner.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        lins = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        lins += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(map(_linear, lins)):
            return f"layer {i} is not Llama-shaped (q/k/v/o and gate/up/down nn.Linear)"
        if getattr(attn, "sliding_window", None) is not None:
            return f"layer {i} uses a sliding window"
        if not fam.qk_norm and any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
            return f"layer {i} normalises q/k, which the {fam.name} family does not declare"
        norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
        if fam.qk_norm:
            norms += [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
        if not all(hasattr(n, "variance_epsilon") and hasattr(n, "weight") for n in norms):
            return f"layer {i} lacks the {fam.name} family's RMSNorms"
        if fam.qk_norm and attn.q_norm.weight.shape != (attn.head_dim,):
            return f"layer {i}'s q/k norms are not over head_dim"
        if len(list(layer.children())) != 4 or len(list(attn.children())) != fam.attention_modules:
            return f"layer {i} has modules beyond the {fam.name} family's"
    return None


class _Layer:
    __slots__ = (
        "ln1", "ln2", "attn", "qkv", "o", "gate_up", "down", "act", "silu", "splits", "mlp_split",
        "q_norm", "k_norm",
    )  # fmt: skip

    def __init__(self, layer, linear=None) -> None:
        linear = linear or _Packed  # (the CUDA forward's: _CatLinear)
        a, m = layer.self_attn, layer.mlp
        self.ln1, self.ln2, self.attn = layer.input_layernorm, layer.post_attention_layernorm, a
        # a family with q/k norms (families.Family.qk_norm: Qwen3), else None
        self.q_norm, self.k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        self.qkv = linear(a.q_proj, a.k_proj, a.v_proj)
        self.o = linear(a.o_proj)
        self.gate_up = linear(m.gate_proj, m.up_proj)
        self.down = linear(m.down_proj)
        self.act = m.act_fn
        self.silu = type(m.act_fn).__name__ in ("SiLU", "SiLUActivation")
        self.splits = self.qkv.splits
        self.mlp_split = m.gate_proj.out_features

    def linears(self):
        return (self.qkv, self.o, self.gate_up, self.down)


class LayerPlan(NamedTuple):
    """What the fused forwards need of one layer, looked up once per refresh (at one token a
    step's 30 layers spent ~1 ms in Python attribute lookups and call frames, the size of the
    attention itself). fn(x, *args) is a linear (the _Packed / _CatLinear .call() forms)."""

    qkv_fn: object
    qkv_args: tuple
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    qk_norm: tuple | None  # (q weight, k weight, eps): Qwen3's per-head norms, else None
    o_fn: object
    o_args: tuple
    ln2_w: torch.Tensor
    ln2_eps: float
    gu_fn: object
    gu_args: tuple
    act_layer: object  # the _Layer where the activation is not SiLU (called from Python)
    down_fn: object
    down_args: tuple
    norm_w: torch.Tensor  # the next layer's input norm (after the last: the final norm)
    norm_eps: float


class LeanDecoder:
    """The lean forward of one model (see the module docstring)."""

    LINEAR = None  # the linears' class (None: _Packed, our CPU kernel); CudaLeanDecoder's
    FUSED = CPU  # the executor of the fused ops on this device (JACOBI_EXT_FUSED=0: REFERENCE)

    def __init__(self, model) -> None:
        self.model = model
        inner = model.model
        self.inner = inner
        self.layers = [
            _Layer(layer, self.LINEAR) for layer in inner.layers[: model.config.num_hidden_layers]
        ]
        self.head = (self.LINEAR or _Packed)(model.lm_head)
        modeling = sys.modules[type(inner.layers[0].self_attn).__module__]
        self.rotary = modeling.apply_rotary_pos_emb
        impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
        if impl == "eager":
            self.attention = modeling.eager_attention_forward
        else:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            self.attention = ALL_ATTENTION_FUNCTIONS[impl]
        self.impl = impl
        self.executor = self.FUSED  # refresh: executors.py, as options say
        self.native = None  # refresh: the layers as one LeanLayers where they can be
        self.native_ar = False  # refresh: whether ar_step runs (its inputs natively too)
        self.greedy_head = None  # refresh: the LM head's greedy form, where it has one
        self.act_dtype = _activation_dtype(model)  # the hidden states' dtype
        self._cast: dict[int, tuple] = {}  # norm_weight's casts: id -> (weight, version, cast)

    def current(self) -> bool:
        """Whether the model's modules are still the ones this decoder packed."""
        layers = self.inner.layers
        if len(layers) < len(self.layers) or self.model.lm_head is not self.head.mods[0]:
            return False
        for L, layer in zip(self.layers, layers, strict=False):
            a, m = layer.self_attn, layer.mlp
            if L.attn is not a or L.qkv.mods != (a.q_proj, a.k_proj, a.v_proj):
                return False
            if L.gate_up.mods != (m.gate_proj, m.up_proj) or L.down.mods[0] is not m.down_proj:
                return False
        return True

    def refresh(self) -> None:
        """Repack what changed; read the switches (options.py: at each prefill, so that a call's
        steps agree)."""
        opts = options()
        self.executor = self.FUSED if opts.fused else REFERENCE
        self._refresh_linears()
        self.plans = [self._plan(i) for i in range(len(self.layers))]
        self.native = self._native_layers() if opts.native else None
        self.native_ar = self.native is not None and self._native_input()
        self.greedy_head = _greedy_head(self.head) if opts.greedy_screen else None

    def _refresh_linears(self) -> None:
        for layer in self.layers:
            for lin in layer.linears():
                lin.refresh()
        self.head.refresh()

    def _plan(self, i: int) -> LayerPlan:
        """Layer i's LayerPlan."""
        L, a = self.layers[i], self.layers[i].attn
        nxt = self.layers[i + 1].ln1 if i + 1 < len(self.layers) else self.inner.norm
        qk = None
        if L.q_norm is not None:
            eps = L.q_norm.variance_epsilon
            if L.k_norm.variance_epsilon != eps:  # (one op normalises both)
                raise ValueError(f"layer {i}: q_norm and k_norm have different epsilons")
            qk = (self.norm_weight(L.q_norm), self.norm_weight(L.k_norm), eps)
        return LayerPlan(
            *L.qkv.call(), L.splits[0] // a.head_dim, L.splits[1] // a.head_dim, a.head_dim,
            a.scaling, qk, *L.o.call(), self.norm_weight(L.ln2), L.ln2.variance_epsilon,
            *L.gate_up.call(), L if not L.silu else None, *L.down.call(), self.norm_weight(nxt),
            nxt.variance_epsilon,
        )  # fmt: skip

    def norm_weight(self, norm) -> torch.Tensor:
        """An RMSNorm's weight in the hidden states' dtype. Checkpoints may keep their norms in
        float32 beside bfloat16 linears; transformers' Llama / Qwen2 / Qwen3 forwards raise on
        such a model (the norm returns float32 into a bfloat16 linear), and our fused ops take
        one dtype. The weight is cast once (kept while the module's weight is unchanged, so a
        captured graph keeps reading the same tensor): the model then runs as it would with its
        norms cast to that dtype (tests/test_lean_forward.py)."""
        w = norm.weight
        if w.dtype == self.act_dtype:
            return w
        kept = self._cast.get(id(norm))
        if kept is None or kept[0] is not w or kept[1] != w._version:
            with torch.no_grad():
                kept = (w, w._version, w.detach().to(self.act_dtype))
            self._cast[id(norm)] = kept
        return kept[2]

    def _norm(self, norm, h: torch.Tensor) -> torch.Tensor:
        """The unfused forward's RMSNorm: the module's own, or (its weight in another dtype)
        the same formula with norm_weight's cast (transformers' LlamaRMSNorm.forward)."""
        if norm.weight.dtype == h.dtype:
            return norm.forward(h)
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return self.norm_weight(norm) * x.to(h.dtype)

    def _native_layers(self):
        """The plans as one torch.classes.jacobi_ext.LeanLayers (csrc/torch/lean_ops.cpp), which
        runs the fused loop's ops from C++ in the same order (bitwise its result, without ~240
        calls from Python a step); None where a layer needs Python (an activation other than
        SiLU, linears that are not one kernel call)."""
        linear = torch.ops.jacobi_ext.cpu_linear.default
        gguf = torch.ops.jacobi_ext.cpu_linear_gguf.default
        native = torch.classes.jacobi_ext.LeanLayers()
        for p in self.plans:
            if p.act_layer is not None:
                return None
            for fn, args in ((p.qkv_fn, p.qkv_args), (p.o_fn, p.o_args), (p.gu_fn, p.gu_args),
                             (p.down_fn, p.down_args)):  # fmt: skip
                if fn is linear:
                    packed, n, bias = args
                    native.add_linear(packed, -1, n, bias, None, None, None, False)
                elif fn is gguf:
                    native.add_linear(*args)
                else:
                    return None
            native.add_layer(p.heads, p.kv_heads, p.scaling, p.ln2_w, p.ln2_eps, p.norm_w,
                             p.norm_eps)  # fmt: skip
            if p.qk_norm is not None:
                native.set_qk_norm(*p.qk_norm)
        return native

    def _native_input(self) -> bool:
        """Give self.native what ar_step needs of the model: the embedding (a Q8_0 GGUF table or
        an nn.Embedding's rows) and the first norm. False where ar_step cannot run: another
        embedding, or rotary tables that _rope_tables cannot keep."""
        emb, first = self.inner.embed_tokens, self.layers[0].ln1
        first_w = self.norm_weight(first)
        if not self._static_rope():
            return False
        if isinstance(emb, GGUFEmbedding) and emb.ggml_type == 8:  # Q8_0
            table, q8_0 = emb.raw_tensor(), True
        elif type(emb) is nn.Embedding and emb.weight.dtype == first_w.dtype:
            table, q8_0 = emb.weight.detach(), False
        else:
            return False
        self.native.set_input(table, q8_0, first_w.detach(), float(first.variance_epsilon))
        return True

    @torch.inference_mode()
    def ar_step(self, toks: torch.Tensor, lo: int, hi: int, rt, greedy: bool = True):
        """One sequence's AR step, its tokens toks [q] (runtime.StaticRuntime.ar_forward: at
        slots [hi, hi + q), seeing [lo, hi + i]) through LeanLayers.ar_step: embedding, rotary
        rows, first norm, mask and slots made natively, then the layers and the head as
        __call__'s (the same values: the same bits). Where native_ar."""
        cache = rt.cache
        ref = self.norm_weight(self.layers[0].ln1)
        cos_tab, sin_tab = self._rope_tables(ref.dtype, ref.device, rt)
        kts, keys, values = cache_lists(cache, self.plans, ref.new_empty(1, 1, 1))
        x = self.native.ar_step(toks, lo, hi, cos_tab, sin_tab, keys, values, kts, rt.scratch)
        return self._head(x, None, greedy)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, view: StepView, rt,
                 keep: int | None = None, greedy: bool = False) -> torch.Tensor:  # fmt: skip
        """Logits [B, Q, vocab] of tokens ids [B, Q] at positions pos [B, Q], their K/V written
        into the runtime rt's cache and attending as `view` says (masks.StepView), through this
        program's executor (executors.py; an executor that reads a plan runs a forward without
        one, a one-pass prefill, on the reference). keep: only the last `keep` positions' logits
        (0: none; a prefill needs the last ones alone; the LM head over a whole prompt cost ~20 %
        of its forward). greedy: the caller wants only the argmax; where the head has a greedy
        form (_greedy_head) the result is that argmax, int64 [B, keep or Q], bitwise targets() of
        the logits, else the logits as without it."""
        run = self.executor
        if run.reads_plan and view.plan is None:
            run = REFERENCE
        return self._head(run.layers(self, ids, pos, view, rt), keep, greedy)

    def _head(self, x: torch.Tensor, keep: int | None, greedy: bool = False) -> torch.Tensor:
        """The LM head on the normed hidden states x [B, Q, hidden], or on their last `keep`
        (0: none, a chunked prefill's middle chunk); greedy: its argmax where it has a greedy
        form (see __call__)."""
        if keep == 0:
            return x.new_empty(x.shape[0], 0, self.model.config.vocab_size)
        if keep is not None and keep < x.shape[1]:
            x = x[:, x.shape[1] - keep :].contiguous()
        if greedy and self.greedy_head is not None:
            return self.greedy_head(x)
        return self.head(x)

    #: rotary embeddings whose frequencies never change with the positions seen
    STATIC_ROPE = ("default", "linear", "llama3")
    ROPE_PIECE = 128  # positions per piece of the tables

    def _cos_sin(self, h: torch.Tensor, pos: torch.Tensor, rt):
        """cos, sin [B, Q, D] of positions pos (all < the runtime rt's capacity), as the model's
        rotary embedding computes them: rows of tables made once per runtime and dtype (its call
        is ten small tensor ops, ~30 us a step). The same bits: it is elementwise (each position
        times each frequency, then cos, sin and the scaling), and the tables are made in pieces
        of 128 positions, each one vectorised pass on one thread as a step's own call is (one
        tensor of every position would be split among threads at points where a scalar tail may
        differ in the last bit; tests/test_lean_forward.py compares every position). Rotary
        embeddings whose frequencies depend on the positions seen, and head sizes off 32 lanes,
        call it."""
        if not self._static_rope():
            return self.inner.rotary_emb.forward(h, pos)
        cos, sin = self._rope_tables(h.dtype, h.device, rt)
        return cos[pos], sin[pos]

    def _static_rope(self) -> bool:
        rope = self.inner.rotary_emb
        D = self.layers[0].attn.head_dim
        return getattr(rope, "rope_type", None) in self.STATIC_ROPE and D % 32 == 0

    def _rope_tables(self, dtype, device, rt) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos, sin tables [>= rt.capacity, D] _cos_sin indexes, made in pieces (see there)
        at the runtime's first step and owned by it (rt.rope_tables): a CUDA graph the runtime
        captured gathers rows from them, so they live as long as its graphs and are never
        replaced (a table kept here and regrown for a larger runtime, a probe's, was freed under
        the graphs of the model's kept runtime: silent wrong tokens)."""
        key = (dtype, device, id(self.inner.rotary_emb))
        tab = rt.rope_tables.get(key)
        if tab is None:
            rope = self.inner.rotary_emb
            h = torch.zeros(1, 1, self.layers[0].attn.head_dim, dtype=dtype, device=device)
            n = -(-rt.capacity // self.ROPE_PIECE) * self.ROPE_PIECE
            pieces = [
                rope.forward(h, torch.arange(i, i + self.ROPE_PIECE, device=device)[None])
                for i in range(0, n, self.ROPE_PIECE)
            ]
            tab = rt.rope_tables[key] = (
                torch.cat([c[0] for c, _ in pieces]),
                torch.cat([s[0] for _, s in pieces]),
            )
        return tab


class CudaLeanDecoder(LeanDecoder):
    """The program on a CUDA model (bf16 or fp32), run by executors.CUDA: nine kernels a layer
    (a q/k/v bias cuBLAS does not fuse: ten), against ~57 ops in transformers' layer. Its
    linears are torch's GEMMs over weights concatenated once. A one-pass prefill (a causal
    prompt, not a step plan) runs executors.REFERENCE over these linears."""

    LINEAR = _CatLinear
    FUSED = CUDA

    def _refresh_linears(self) -> None:
        """Every linear's weight probe read in one device -> host copy (a read per linear would
        be ~200 synchronisations at each call's start), then each rewritten if it changed."""
        linears = [lin for layer in self.layers for lin in layer.linears()] + [self.head]
        probed = prepack.probes([m.weight for lin in linears for m in lin.mods])
        for lin in linears:
            lin.refresh(probed)

    def _native_layers(self):
        return None  # (LeanLayers runs the CPU ops)


def _activation_dtype(model) -> torch.dtype:
    """The dtype of the hidden states: the embedding's (float32 for GGUF codes)."""
    w = getattr(model.model.embed_tokens, "weight", None)
    if isinstance(w, torch.Tensor) and w.is_floating_point():
        return w.dtype
    return torch.float32


def _unsupported_cuda(model) -> str | None:
    """Why `model` (on a CUDA device) cannot run the CUDA lean forward (None: it can)."""
    reason = _unsupported(model)
    if reason is not None:
        return reason
    p = next(model.parameters())
    if p.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {p.dtype} (float32 or bfloat16 only)"
    inner = model.model
    if type(inner.embed_tokens) is not nn.Embedding:
        return "embed_tokens is not an nn.Embedding (GGUF codes run on the CPU)"
    for i, layer in enumerate(inner.layers):
        mods = [*layer.self_attn.children(), *layer.mlp.children(), model.lm_head]
        if any(isinstance(m, GGUFLinear) for m in mods):
            return f"layer {i} reads GGUF codes (a CPU format)"
        if layer.self_attn.head_dim not in (64, 128):
            return f"head dim {layer.self_attn.head_dim} (the CUDA attention takes 64 and 128)"
    return None


def lean_decoder(model) -> LeanDecoder | None:
    """The model's lean forward, packed and up to date, or None where it does not apply."""
    if not options().lean:
        return None
    which = prepack.lean_backend(model)
    if torch.is_grad_enabled() or which is None:
        return None  # (the runtime's forwards run under inference mode)
    entry = model.__dict__.get(_ATTR)
    if isinstance(entry, LeanDecoder) and not entry.current():
        entry = None  # modules were replaced (an adapter wrapped or unloaded): rebuild
    if isinstance(entry, LeanDecoder) and isinstance(entry, CudaLeanDecoder) != (which == "cuda"):
        entry = None  # the model moved between devices
    if entry is None:
        if which == "cuda":
            reason = _unsupported_cuda(model)
            entry = CudaLeanDecoder(model) if reason is None else reason
        else:
            reason = _unsupported(model)
            entry = LeanDecoder(model) if reason is None else reason
        object.__setattr__(model, _ATTR, entry)
    if isinstance(entry, str):
        return None
    entry.refresh()
    return entry


def why_not(model) -> str | None:
    """Why the lean forward does not run for `model` (None: it does)."""
    if not options().lean:
        return "JACOBI_EXT_LEAN=0"
    which = prepack.lean_backend(model)
    if which == "cuda":
        return _unsupported_cuda(model)
    if which is None:
        return (
            f"its linears do not run on the CPU kernel (backend {prepack.backend(model)}) and it "
            "is not a float32 / bfloat16 model on a CUDA build's GPU"
        )
    return _unsupported(model)
