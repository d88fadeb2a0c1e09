"""The static decoding runtime: one preallocated KV cache, fixed-shape steps, CUDA graphs.

Every method (`ar`, `jacobi`, `multiblock`, with or without lookup rows) and every batch size
runs its forwards through a StaticRuntime. The model's own transformers modules do the forward;
we only hand them a cache (a StaticCache subclass), position ids and a 4-D custom mask.

**Slots, not positions.** Each layer's K/V live in [B, H, capacity, D] buffers. A sequence's
committed tokens occupy the slots [lo[b], hi[b]) (the left-padded prompt, then what was
generated); the first `scratch` slots are where a step writes the tokens it feeds (query i ->
slot i). Because keys carry their RoPE position, attention does not care about slot order, so
after the verify op has picked what to commit:
  - truncating the rejected tokens is nothing at all (they stay in scratch, masked, and the
    next step overwrites them);
  - the accepted tokens of the winning row (main row or a candidate) are copied from scratch to
    [hi, hi + a) with fixed-shape index tensors, and hi += a.
Both are device-side and read no host value, so they could live inside a graph. On a CPU, one
sequence's AR steps (`ar`, with or without lookup drafts) write at [hi, hi + q) instead, where
the tokens they accept stay: their commit only moves hi (`writes_in_place`).

**Graphs.** On CUDA each step width is padded to a bucket (1, 2, 4, ... scratch) and replayed
from a torch.cuda.CUDAGraph captured once per bucket (`replay`, graphs.py): for decoding, the
whole step of the batch (step.py: ids, mask, positions, the forward, the targets, the verify op,
the K/V commit and the next drafts); for the tuner's probe, the forward alone (`step`). The
runtime (and so its graphs) is kept on the model and reused across `generate` calls while the
batch size fits and the capacity suffices. If capture fails on an exotic model, the runtime
warns once and runs eagerly: never a crash, never a different token. The prefill is replayed
too, as chunks of PREFILL_CHUNK prompt tokens, each a one-row step committed before the next
(`prefill_chunk`).

On CPU the same runtime runs eagerly, with unpadded widths, and attends only up to the longest
committed sequence (no cost for unused capacity). An fp32 or bf16 model's linears run from weights
packed once (prepack.py: our decode-shaped kernel, a fraction of `F.linear`'s time), and a
Llama-family model runs the lean forward (lean.py: the same logits, less Python).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import StaticCache, StaticLayer

from ..models.quantized import kv_cache_dtype
from .graphs import GraphReplay, graphs_wanted
from .lean import lean_decoder
from .masks import StepPlan, StepView, for_backend, prefill_mask, step_positions
from .options import options
from .prepack import cuda_decode_on, packed


def targets(logits: torch.Tensor) -> torch.Tensor:
    """The tokens the model predicts after each position: the greedy argmax. The one place the
    decoding turns logits into tokens (prefill and every step); under sampling the step's rule
    (jacobi_ext.decoding.sampling.Sampler: the filtered perturbed argmax) replaces exactly this.
    On CPU our `argmax`: the index torch's max(-1) and argmax give (the first of tied maxima,
    as transformers' greedy takes it; tests), with the vocabulary read in parallel halves, where
    the LM head's threads left them: torch's max took 0.17-0.26 ms of a ~10 ms step there
    (~0.05 ms on logits in one cache)."""
    if logits.device.type == "cpu" or cuda_decode_on(logits.device):  # (CUDA: its twin)
        return torch.ops.jacobi_ext.argmax(logits)
    return logits.argmax(-1)


def _targets(out: torch.Tensor) -> torch.Tensor:
    """targets() of a forward asked for greedy=True: its logits, or already their argmax (int64,
    from a greedy LM head: lean.py, _GreedyHead)."""
    return out if out.dtype == torch.long else targets(out)


def bucket(q: int) -> int:
    """The padded width of a step feeding q tokens: the next power of two."""
    return 1 << max(0, (q - 1).bit_length())


class SlotLayer(StaticLayer):
    """A StaticLayer that writes where the runtime says (its current StepView's slots) and returns
    the buffers up to the runtime's attended width. Its buffers hold the runtime's K/V element
    type (`kv_dtype`: the model's, or float16 for a half cache on a CPU)."""

    def __init__(self, max_cache_len: int, runtime: StaticRuntime) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self._rt = runtime

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *a, **kw):
        kv = self._rt.kv_dtype
        super().lazy_initialization(key_states.to(kv), value_states.to(kv), *a, **kw)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots, w = self._rt.view.slots, self._rt.view.width
        self.keys.index_copy_(2, slots, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, slots, value_states.to(self.values.dtype))
        k, v = self.keys[:, :, :w], self.values[:, :, :w]
        if k.dtype != key_states.dtype:  # a half cache, read by an attention of the model's dtype
            return k.to(key_states.dtype), v.to(value_states.dtype)
        return k, v

    def get_seq_length(self) -> int:  # positions are always passed explicitly
        return 0


class SlotCache(StaticCache):
    """transformers' StaticCache whose layers are SlotLayers (see the module docstring)."""

    def __init__(self, config, capacity: int, runtime: StaticRuntime) -> None:
        super().__init__(config=config, max_cache_len=capacity)
        for i, layer in enumerate(self.layers):
            if type(layer) is not StaticLayer:
                raise ValueError(
                    f"layer {i} uses a {type(layer).__name__} cache (sliding window, chunked or "
                    "recurrent state); jacobi_ext's decoding supports full-attention models "
                    "(Llama, Qwen2, ...)"
                )
        self.layers = [SlotLayer(capacity, runtime) for _ in self.layers]


def cache_kwarg(model) -> str:
    """The keyword the model's forward takes its KV cache under. transformers 5.24 renamed
    `past_key_values` to `cache` (the old name warns on every call and goes in 5.40); before, only
    `past_key_values` exists. Read from the forward's own signature (transformers' deprecation
    decorator keeps it visible), so a remote-code model that still says `past_key_values` gets
    that; a forward taking only **kwargs gets the name of the installed transformers."""
    params = inspect.signature(type(model).forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    from transformers import LlamaForCausalLM  # a stock model of the installed transformers

    stock = inspect.signature(LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in stock else "past_key_values"


PREFILL_CHUNK = 64  # prompt tokens per captured prefill chunk on CUDA (see prefill_chunk)


def prefill_chunk(graph_mode: str | None) -> int:
    """Prompt tokens a prefill feeds per forward (0: the whole prompt in one forward). On CUDA
    with graphs, a prompt runs as chunks of PREFILL_CHUNK tokens, each a step of one row (the
    step plan's causal rule) replayed from a graph captured once, then committed: a prompt's
    forward in one eager pass launched every op of every layer from Python (the time of a few
    hundred decoded tokens on a GPU; docs/results/h200-2026-12-04). On a CPU one pass is faster
    (one large product per linear, no launches to save). JACOBI_EXT_PREFILL_CHUNK=N sets it
    (0: one pass), on any device."""
    chunk = options().prefill_chunk
    if chunk is not None:
        return chunk
    return PREFILL_CHUNK if graph_mode is not None else 0


class StaticRuntime(GraphReplay):
    """Preallocated cache + fixed-shape step buffers for a batch of B sequences."""

    def __init__(
        self, model, batch: int, committed: int, scratch: int, cuda_graphs: bool | None = None
    ) -> None:
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        self.kv_dtype = kv_cache_dtype(model)  # the cache's elements: dtype, or a CPU's fp16
        self.B, self.scratch, self.committed = batch, scratch, committed
        self.capacity = scratch + committed
        dev = self.device
        self.cache = SlotCache(model.config, self.capacity, self)
        self._cache_arg = {cache_kwarg(model): self.cache}  # forward(**self._cache_arg)
        # transformers' causal LMs compute the head on the last positions alone when asked
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        # Static inputs of a step (graphs read them in place: never rebind, only copy_ / fill_).
        self.ids = torch.zeros(batch, scratch, dtype=torch.long, device=dev)
        self.seg = torch.full((batch, scratch), -1, dtype=torch.long, device=dev)
        self.off = torch.zeros(batch, scratch, dtype=torch.long, device=dev)
        self.lo = torch.full((batch,), scratch, dtype=torch.long, device=dev)
        self.hi = torch.full((batch,), scratch, dtype=torch.long, device=dev)
        self._slots = torch.arange(max(scratch, 1), device=dev)
        self._rows = torch.arange(batch, device=dev)[:, None]
        self.view = StepView(None, self._slots, self.capacity)  # the forward's (_logits sets it)
        self.graph_mode = graphs_wanted(dev, cuda_graphs)
        self.use_graphs = self.graph_mode is not None  # fixed widths, all slots attended
        self._graphs: dict[object, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.batch_steps: dict[object, object] = {}  # step.BatchStep per decoding setting
        self.graphs_requested = self.graph_mode  # stays, even if a capture fails
        # A chunked prefill's commit of each chunk (static: its graphs read them in place).
        self.prefill_chunk = min(prefill_chunk(self.graph_mode), scratch)
        self._pf_src = torch.zeros(batch, dtype=torch.long, device=dev)
        self._pf_count = torch.zeros(batch, dtype=torch.long, device=dev)
        self._pool = None
        self.warmup_seconds = 0.0  # spent capturing graphs (once per bucket)
        self.graph_replays = 0
        self._lean = None  # lean.LeanDecoder, False where it does not apply; set at prefill
        # The lean forward's rotary tables, made at the first step (lean._rope_tables): owned
        # here, so that they live as long as the graphs that gather from them.
        self.rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._captured_reads: tuple | None = None  # step_reads() when the graphs were captured
        self._lo_host = scratch  # self.lo[0], as the last prefill set it
        ops = torch.ops.jacobi_ext
        native_commit = dev.type == "cpu" or cuda_decode_on(dev)
        self._kv_commit = (  # (on CUDA: one kernel for every layer, csrc/cuda/decode_cuda.cu)
            ops.kv_commit if native_commit and hasattr(ops, "kv_commit") else None
        )

    def fits(self, model, batch: int, committed: int, scratch: int) -> bool:
        """Whether this runtime can serve a call of that size on the model as it is now. (Its
        graphs' forward and weights are checked at each prefill: _pick_forward.)"""
        p = next(model.parameters())
        return (
            model is self.model
            and batch == self.B
            and committed <= self.committed
            and scratch <= self.scratch
            and (p.device, p.dtype) == (self.device, self.dtype)
            and kv_cache_dtype(model) == self.kv_dtype
        )

    def _logits(self, ids: torch.Tensor, pos: torch.Tensor, view: StepView,
                prefill: bool = False, keep: int | None = None, greedy: bool = False):  # fmt: skip
        """The model's forward as every runtime call makes it: our cache under the installed
        transformers' keyword, and on CPU the linears from packed weights (prepack.py: our
        kernel, whose rows do not depend on each other, or oneDNN's on AMX); for Llama-family
        models on our kernel, the lean forward (lean.py: the same logits, less Python). Its packed
        weights are checked against the model's at each prefill (weights do not change inside a
        generate call; checking all of them at every step cost 0.8 ms of a 15 ms step).
        keep: the logits of the last `keep` positions only (None: all). greedy: only their
        argmax is wanted; the result may then be it (int64: the lean forward's greedy head),
        see _targets. view: what the step's attention reads and where its K/V go (masks.py); the
        cache's layers (SlotLayer) read it from here."""
        self.view = view
        lean = self._pick_forward() if prefill or self._lean is None else self._lean
        if lean:
            return lean(ids, pos, view, self, keep, greedy)
        mask = for_backend(self.model, view.mask(), self.dtype)
        kw = dict(self._cache_arg)
        if keep is not None and self._keeps_logits:
            kw["logits_to_keep"] = max(keep, 1)  # (transformers reads 0 as "all")
        with packed(self.model):
            logits = self.model(
                input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, **kw
            ).logits
        return logits if keep is None else logits[:, logits.shape[1] - keep :]

    def _pick_forward(self):
        """The lean forward (repacked where the model's weights changed) or False where it does
        not apply: picked at each prefill, kept for the steps after it. Graphs captured with
        another forward or over other weights are dropped here (recaptured at their next use)."""
        self._lean = lean_decoder(self.model) or False
        if self._graphs and self.step_reads() != self._captured_reads:
            self.drop_graphs()
        return self._lean

    def step_reads(self) -> tuple:
        """What a captured step reads besides the runtime's own buffers, as identities: the
        forward (the lean decoder object and its mode, or transformers') and the address of
        every weight it reads (the model's parameters and buffers, the lean forward's packed or
        concatenated weights and cast norms) and of the rotary tables. A CUDA graph replays
        reads from the addresses it was captured with: while this is unchanged they hold what
        the forward would read now. An adapter wrapped or unloaded (the lean forward rebuilt
        over other weights), a weight replaced rather than written in place, or another forward
        picked changes it."""
        lean = self._lean
        mode = (id(lean), lean.executor.name) if lean else (None,)
        ptrs = [t.data_ptr() for t in self.model.parameters()]
        ptrs += [t.data_ptr() for t in self.model.buffers()]
        if lean:
            ptrs += [t.data_ptr() for t in _tensors(lean.plans)]
            ptrs += [t.data_ptr() for t in _tensors(lean.head.call()[1])]
        ptrs += [t.data_ptr() for t in _tensors(list(self.rope_tables.values()))]
        return (*mode, tuple(ptrs))

    # ---- prefill ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, pad: torch.Tensor, drafts: torch.Tensor | None,
                rule=None, all_targets: bool = False):  # fmt: skip
        """Forward the left-padded prompts ids [B, P] (pad[b] padding tokens first) and, for the
        parallel methods, draft tokens [B, n] after them (their K/V go to scratch, i.e. are not
        kept). Returns the targets [B, n + 1] of the prompt's last token and the drafts: the
        argmax, or rule(logits, positions) (sampling: jacobi_ext.decoding.sampling.Sampler).
        Decoding needs no other; the LM head over every prompt position cost ~15-30 % of a
        prefill (a 170-token prompt on the default model). all_targets=True: [B, P + n]."""
        B, P = ids.shape
        n = 0 if drafts is None else drafts.shape[1]
        if P > self.committed or n > self.scratch:
            raise ValueError(f"prompt of {P} tokens does not fit a cache of {self.committed}")
        if not all_targets and 0 < n + 1 <= self.prefill_chunk:
            return self._prefill_chunked(ids, pad, drafts, rule)
        dev = self.device
        i = torch.arange(P, device=dev)
        pos = (i[None, :] - pad[:, None]).clamp_(min=0)
        x = ids
        slots = self.scratch + i
        if n:
            k = torch.arange(n, device=dev)
            pos = torch.cat([pos, (P - pad)[:, None] + k[None, :]], dim=1)
            x = torch.cat([ids, drafts], dim=1)
            slots = torch.cat([slots, k])
        mask = prefill_mask(pad, P, n, self.scratch)
        view = StepView(None, slots, self.scratch + P, prefill=mask)
        keep = None if all_targets else n + 1
        logits = self._logits(x, pos, view, prefill=True, keep=keep, greedy=rule is None)
        if keep is not None:
            pos = pos[:, pos.shape[1] - keep :]
        self.lo.copy_(self.scratch + pad)
        self.hi.fill_(self.scratch + P)
        self._lo_host = self.scratch + int(pad[0])
        return _targets(logits) if rule is None else rule(logits, pos)

    def _prefill_chunked(self, ids: torch.Tensor, pad: torch.Tensor,
                         drafts: torch.Tensor | None, rule=None) -> torch.Tensor:  # fmt: skip
        """prefill() as steps of C = prefill_chunk tokens: the same slots, positions and
        visibility, so the same result up to the order of float sums. The prompt and drafts
        (P + n tokens, left-padded per row) are left-padded further to T, a multiple of C, so
        that the last chunk ends with the drafts. Each chunk is one row (seg 0, offsets counting
        that row's prompt tokens not yet committed; padding -1): the step plan's rule makes it
        causal over the committed prompt and itself. After its forward, each row's prompt tokens
        of the chunk move from scratch to [hi, hi + count) (the step's commit); the drafts stay
        in scratch, as in one pass. Only the last chunk computes logits (its last n + 1). On CUDA
        each chunk is a graph replay: two graphs per setting (a middle chunk, the last)."""
        B, P = ids.shape
        n = 0 if drafts is None else drafts.shape[1]
        C, dev = self.prefill_chunk, self.device
        T = -(-(P + n) // C) * C
        e = T - (P + n)
        pad_h = pad.to("cpu", torch.long)
        start = e + pad_h[:, None]  # [B, 1] each row's first prompt token, in [0, T)
        x = torch.arange(T)[None, :]
        chunk0 = (x // C) * C  # each position's chunk start
        committed_before = (torch.minimum(chunk0, torch.tensor(e + P)) - start).clamp(min=0)
        real = x >= start
        seg = torch.where(real, 0, -1)
        off = torch.where(real, x - start - committed_before, 0)
        k0 = torch.arange(0, T, C)[None, :]  # [1, chunks]
        src = (start - k0).clamp(0, C)  # [B, chunks] first prompt token's scratch slot
        count = (torch.clamp(k0 + C, max=e + P) - torch.maximum(k0, start)).clamp(min=0)
        # the whole plan in one host -> device copy: [seg, off] per position, then [src, count]
        # per chunk
        both = torch.cat([torch.stack([seg, off]), torch.stack([src, count])], dim=2).to(dev)
        plan, moves = both[..., :T], both[..., T:]
        fed = [ids.new_zeros(B, e), ids] + ([drafts.to(ids.dtype)] if n else [])
        fed = torch.cat(fed, dim=1)
        first = int(pad_h.min()) + e  # chunks of padding alone (for every row) are skipped
        self._pick_forward()  # here, not in a chunk: a graph replay would not repeat it
        self.lo.copy_(self.scratch + pad)
        self.hi.copy_(self.scratch + pad)
        self._lo_host = self.scratch + int(pad_h[0])
        attend = self.scratch + P  # eager steps see up to the longest prompt
        keep = n + 1
        out = None
        for c, k in enumerate(range(0, T, C)):
            if k + C <= first:
                continue
            last = k + C == T
            self.ids[:, :C].copy_(fed[:, k : k + C])
            self.seg[:, :C].copy_(plan[0, :, k : k + C])
            self.off[:, :C].copy_(plan[1, :, k : k + C])
            self._pf_src.copy_(moves[0, :, c])
            self._pf_count.copy_(moves[1, :, c])

            def chunk(keep=keep if last else 0):
                got = self.forward(C, attend, rule, keep=keep)
                self.commit(self._pf_src, self._pf_count)
                return got

            # (a last chunk's graph holds its setting's rule: one per rule)
            key = ("prefill", C, keep, id(rule)) if last else ("prefill", C, 0)
            out = self.replay(key, chunk, neutral=(self._pf_count,))
        return out

    # ---- one step ------------------------------------------------------------------------------
    def writes_in_place(self) -> bool:
        """Whether a step of one sequence feeding one row in order (`ar`, `ar` with lookup
        drafts) may write its K/V straight after the committed tokens, where those it accepts
        stay: then the commit only moves `hi` (it moved them from scratch: ~0.25 ms a step on
        CPU, ~60 scattered copies). Only on our fused CPU attention, which sums a row's keys in
        position order wherever they sit (DecodeAttnArgs::first): the same bits as from scratch."""
        lean = self._lean
        in_place = bool(lean) and lean.executor.writes_in_place
        return self.device.type == "cpu" and self.B == 1 and in_place

    def _forward(self, Q: int, attend: int, rule=None, in_place: bool = False,
                 keep: int | None = None) -> torch.Tensor | None:  # fmt: skip
        seg, off = self.seg[:, :Q], self.off[:, :Q]
        plan = StepPlan(seg, off, self.lo, self.hi)
        if in_place:  # writes_in_place(): slots [hi, hi + Q), the mask's local columns there
            hi = int(self.hi[0])
            view = StepView(plan, self._slots[:Q] + hi, hi + Q, write_at=hi)
        else:
            view = StepView(plan, self._slots[:Q], attend)
        pos = step_positions(off, self.lo, self.hi)
        logits = self._logits(self.ids[:, :Q], pos, view, keep=keep, greedy=rule is None)
        if keep is not None:  # (keep 0: the K/V writes alone, a chunked prefill's middle)
            if keep == 0:
                return None
            pos = pos[:, Q - keep :]
        return _targets(logits) if rule is None else rule(logits, pos)

    def ar_forward(self, toks: torch.Tensor, hi: int) -> torch.Tensor:
        """One sequence's AR step outside the batch step (where writes_in_place(), greedy): its
        fed tokens `toks` [q] (the seed, then lookup drafts) at slots [hi, hi + q), hi its committed
        end (the host's copy of self.hi[0]); returns their targets [1, q]. The same forward as
        forward(q, ..., in_place=True) on the same inputs (the same mask, positions, slots and
        ops, so the same bits; tests/test_decoding_fast_ar.py), without the batch step's
        fixed-shape bookkeeping (input rows, gathers, the commit op, the packed row), its inputs
        made natively where the lean forward can (lean.LeanDecoder.ar_step; what it saves:
        docs/results/cpu-floor-2026-12-05). The caller commits: self.hi += accepted."""
        q = len(toks)
        if self._lean.native_ar:  # the step's inputs made natively too (lean.ar_step)
            return _targets(self._lean.ar_step(toks, self._lo_host, hi, self))
        # else the in-place step's own forward on these tokens (one row, offsets 0..q-1)
        self.ids[0, :q] = toks
        self.seg[0, :q] = 0
        self.off[0, :q] = self._slots[:q]
        return self._forward(q, hi + q, None, True)[:, :q]

    def width(self, q: int) -> int:
        """The width a step feeding at most q tokens per sequence runs at."""
        return min(bucket(q), self.scratch) if self.use_graphs else q

    def forward(self, Q: int, attend: int, rule=None, in_place: bool = False,
                keep: int | None = None) -> torch.Tensor | None:  # fmt: skip
        """The forward over self.ids/seg/off[:, :Q] (filled by the caller): targets [B, Q], the
        argmax or rule(logits, positions). `attend` is the number of slots an eager step needs
        to see (graphs see them all). in_place (where writes_in_place()): the step's K/V go to
        [hi, hi + Q) rather than to scratch, and its commit (in_place=True) moves none."""
        return self._forward(Q, self.capacity if self.use_graphs else attend, rule, in_place, keep)

    @torch.inference_mode()
    def step(self, Q: int, attend: int) -> torch.Tensor:
        """The forward alone, as a step runs it (a graph replay per width on CUDA): the tuner's
        and the benchmarks' probe."""
        return self.replay(("forward", Q), lambda: self.forward(Q, attend))

    # ---- commit ---------------------------------------------------------------------------------
    def _kv_bufs(self) -> list[torch.Tensor]:
        return [buf for layer in self.cache.layers for buf in (layer.keys, layer.values)]

    def commit(self, src: torch.Tensor | None, count: torch.Tensor, in_place: bool = False) -> None:
        """The step's one commit: for each sequence b, move the K/V of scratch slots
        [src[b], src[b] + count[b]) to [hi[b], hi[b] + count[b]) and advance hi[b]
        (count[b] <= scratch). Fixed shapes and no host values: it runs inside the step's graph.
        The move is the kv_commit op (one native call for all layers on a CPU, one kernel on
        CUDA), or where this build has none for the device its torch statement
        (_commit_reference). in_place: the step ran forward(in_place=True), so the K/V to keep
        already sit at [hi, hi + count): only hi moves (src unused)."""
        if not in_place and self._kv_commit is not None:
            # (no walrus here: the step traces under torch.compile, which cannot read its cell)
            kts = [
                layer.keys_t
                for layer in self.cache.layers
                if getattr(layer, "keys_t", None) is not None
            ]
            self._kv_commit(self._kv_bufs(), src, self.hi, count, kts)
        elif not in_place:
            self._commit_reference(src, count)
        self.hi.add_(count)

    def _commit_reference(self, src: torch.Tensor, count: torch.Tensor) -> None:
        """kv_commit's move in torch ops (an indexed copy per buffer, ~25 us a layer on a CPU):
        for a device without our kernel."""
        width = self.scratch
        ar = self._slots[:width][None, :]
        valid = ar < count[:, None]
        s = torch.where(valid, src[:, None] + ar, ar)
        d = torch.where(valid, self.hi[:, None] + ar, ar)
        rows = self._rows.expand(-1, width)
        for layer in self.cache.layers:
            for buf in (layer.keys, layer.values):
                t = buf.transpose(1, 2)  # [B, slots, H, D] view
                t[rows, d] = t[rows, s]


def _tensors(obj):
    """The tensors in obj, a tensor or nested tuples / lists of them and other values."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)


def runtime_for(
    model, batch: int, committed: int, scratch: int, cuda_graphs: bool | None = None
) -> StaticRuntime:
    """The model's runtime, reused (with its captured graphs) when it fits; else a new one sized
    with some headroom so that the next calls fit too."""
    rt: StaticRuntime | None = getattr(model, "_jacobi_runtime", None)
    want = graphs_wanted(next(model.parameters()).device, cuda_graphs)
    if rt is not None and rt.fits(model, batch, committed, scratch) and rt.graphs_requested == want:
        return rt
    if rt is not None:
        committed = max(committed, rt.committed) if rt.B == batch else committed
        scratch = max(scratch, rt.scratch) if rt.B == batch else scratch
    scratch = max(scratch, prefill_chunk(want))  # a prefill chunk is a step of that width
    rt = StaticRuntime(model, batch, committed, bucket(scratch), cuda_graphs)
    try:
        object.__setattr__(model, "_jacobi_runtime", rt)  # not a submodule: no state_dict entry
    except (AttributeError, TypeError):  # pragma: no cover
        pass
    return rt


class StepProbe:
    """One decoding step of q new tokens over a fixed committed context, run exactly as the
    engine runs it (same runtime, same buckets, graph replay on CUDA): what the tuner and the
    forward-latency benchmark time. Nothing is committed, so every call sees the same cache."""

    def __init__(self, model, context: int = 256, max_q: int = 256, seed: int = 0) -> None:
        p = next(model.parameters())
        self.dev = p.device
        vocab = model.get_output_embeddings().out_features  # nn.Linear or GGUFLinear
        g = torch.Generator().manual_seed(seed)
        self.rt = StaticRuntime(model, 1, context + 1, bucket(max_q))
        ctx = torch.randint(0, vocab, (1, context), generator=g).to(self.dev)
        self.tokens = torch.randint(0, vocab, (max_q,), generator=g).to(self.dev)
        self.attend = self.rt.scratch + context
        self.rt.prefill(ctx, torch.zeros(1, dtype=torch.long, device=self.dev), None)

    @torch.inference_mode()
    def __call__(self, q: int) -> torch.Tensor:
        rt = self.rt
        Q = rt.width(q)
        rt.ids[0, :q] = self.tokens[:q]
        rt.seg[0, :Q] = -1
        rt.seg[0, :q] = 0
        rt.off[0, :Q] = torch.arange(Q, device=self.dev)
        return rt.step(Q, self.attend)
