"""The chunked prefill (runtime.StaticRuntime._prefill_chunked): a prompt fed as steps of C tokens,
each committed before the next, gives the one-pass prefill's targets, logits (to float rounding)
and cache, on every forward a step can run (transformers' forward with the step mask, the CPU
lean forward, the CUDA lean forward's plan path on its CPU twins), and every method decodes the
same tokens after it. CUDA runs it by default (graphs); here JACOBI_EXT_PREFILL_CHUNK forces it.
The GPU run is test_cuda_decode_ops.py."""

import pytest
import torch

from jacobi_ext.decoding import prepack, runtime
from jacobi_ext.decoding.engine import generate
from jacobi_ext.decoding.runtime import StaticRuntime, prefill_chunk
from jacobi_ext.models import tiny_llama

VOCAB = 101


def _model(family="llama", dtype=torch.float64, seed=0, head_dim=16):
    m = tiny_llama(
        vocab_size=VOCAB, hidden_size=4 * head_dim, num_layers=2, num_heads=4, num_kv_heads=2,
        seed=seed, family=family,
    )  # fmt: skip
    if family == "qwen2":  # q/k/v biases that count
        with torch.no_grad():
            for layer in m.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 1)
    return m.to(dtype)


def _prefill(model, monkeypatch, chunk, ids, pad, drafts):
    """(logits the prefill's rule saw, its positions, lo, hi, each layer's committed K/V)."""
    monkeypatch.setenv("JACOBI_EXT_PREFILL_CHUNK", str(chunk))
    B, P = ids.shape
    rt = StaticRuntime(model, B, P + 8, 16)
    assert rt.prefill_chunk == chunk
    seen = {}

    def keep(logits, pos):
        seen["pos"] = pos.clone()
        return logits.clone()

    logits = rt.prefill(ids, pad, drafts, rule=keep)
    kv = []
    for b in range(B):
        lo, hi = int(rt.lo[b]), int(rt.hi[b])
        kv.append([(c.keys[b, :, lo:hi].clone(), c.values[b, :, lo:hi].clone())
                   for c in rt.cache.layers])  # fmt: skip
    return logits, seen["pos"], rt.lo.clone(), rt.hi.clone(), kv


def _case(seed, B, P, n):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, P), generator=g)
    pad = torch.randint(0, P, (B,), generator=g)
    pad[0] = 0  # one full-length prompt, the others left-padded
    drafts = torch.randint(0, VOCAB, (B, n), generator=g) if n else None
    return ids, pad, drafts


def _assert_same(got, ref, **tol):
    logits, pos, lo, hi, kv = got
    logits0, pos0, lo0, hi0, kv0 = ref
    assert torch.equal(pos, pos0) and torch.equal(lo, lo0) and torch.equal(hi, hi0)
    torch.testing.assert_close(logits, logits0, **tol)
    assert torch.equal(logits.argmax(-1), logits0.argmax(-1))
    for row, row0 in zip(kv, kv0, strict=True):
        for (k, v), (k0, v0) in zip(row, row0, strict=True):
            torch.testing.assert_close(k, k0, **tol)
            torch.testing.assert_close(v, v0, **tol)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("lean_env", ["0", "1"], ids=["transformers", "lean"])
@pytest.mark.parametrize(
    "seed,B,P,n,chunk",
    [(0, 1, 13, 0, 4), (1, 3, 23, 4, 8), (2, 2, 16, 3, 4), (3, 4, 9, 7, 8), (4, 3, 30, 0, 16)],
)
def test_chunked_prefill_is_the_one_pass_prefill(family, lean_env, seed, B, P, n, chunk,
                                                 monkeypatch):  # fmt: skip
    """Random ragged batches, with and without drafts, chunks that do and do not divide the
    prompt, a last chunk the drafts fill (n + 1 == C): the same positions, slots and cache, and
    the logits to float64 rounding (the sums meet the same keys, split across chunks)."""
    monkeypatch.setenv("JACOBI_EXT_LEAN", lean_env)
    model = _model(family)
    ids, pad, drafts = _case(seed, B, P, n)
    ref = _prefill(model, monkeypatch, 0, ids, pad, drafts)
    got = _prefill(model, monkeypatch, chunk, ids, pad, drafts)
    _assert_same(got, ref, rtol=1e-10, atol=1e-10)


def test_chunked_prefill_on_the_cuda_plan_path(monkeypatch):
    """The CUDA lean forward's plan path (its ops' CPU twins), float32: the chunks pass the step
    plan (no mask), the same result."""
    monkeypatch.setattr(prepack, "lean_backend", lambda model: "cuda")
    model = _model(dtype=torch.float32, head_dim=64)
    ids, pad, drafts = _case(5, 3, 21, 3)
    ref = _prefill(model, monkeypatch, 0, ids, pad, drafts)
    seen = []
    real = runtime.StaticRuntime._logits

    def spy(self, ids, pos, view, prefill=False, keep=None, greedy=False):
        seen.append((type(view.plan).__name__, self._lean.executor.name))
        return real(self, ids, pos, view, prefill=prefill, keep=keep, greedy=greedy)

    monkeypatch.setattr(runtime.StaticRuntime, "_logits", spy)
    got = _prefill(model, monkeypatch, 8, ids, pad, drafts)
    # 21 + 3 tokens: three chunks of 8, each a step plan run by the CUDA executor (no mask)
    assert seen[-3:] == [("StepPlan", "cuda")] * 3
    _assert_same(got, ref, rtol=1e-5, atol=1e-5)


def test_chunks_of_padding_alone_are_skipped_and_middles_skip_the_head(monkeypatch):
    """A long prompt beside short ones: chunks where every row is padding do not run; only the
    last chunk asks for logits (the middle chunks' forwards keep none)."""
    model = _model()
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(6))
    pad = torch.tensor([13, 11])  # 7 and 9 real tokens: the first two chunks of 4 are padding
    calls = []
    real = runtime.StaticRuntime._logits

    def spy(self, ids, pos, view, prefill=False, keep=None, greedy=False):
        calls.append(keep)
        return real(self, ids, pos, view, prefill=prefill, keep=keep, greedy=greedy)

    monkeypatch.setattr(runtime.StaticRuntime, "_logits", spy)
    ref = _prefill(model, monkeypatch, 0, ids, pad, None)
    calls.clear()
    got = _prefill(model, monkeypatch, 4, ids, pad, None)
    assert calls == [0, 0, 1]  # chunks [8, 12), [12, 16), [16, 20)
    _assert_same(got, ref, rtol=1e-10, atol=1e-10)


METHODS = {
    "ar": dict(method="ar"),
    "ar lookup": dict(method="ar", lookup=True),
    "jacobi n=4": dict(method="jacobi", block_size=4, lookup=False),
    "jacobi n=7 lookup": dict(method="jacobi", block_size=7, lookup=True),
    "multiblock": dict(method="multiblock", block_size=3, num_blocks=2, pool_size=2),
}


@pytest.mark.parametrize("path", ["transformers", "lean", "plan"])
def test_every_method_after_a_chunked_prefill_is_our_ar(path, monkeypatch):
    """Decoding after a chunked prefill: every method returns exactly our `ar` after a one-pass
    prefill (float64 for transformers' forward; float32 on the lean and plan paths, whose ar
    runs on the same kernels), ragged batch of 3."""
    monkeypatch.setenv("JACOBI_EXT_LEAN", "0" if path == "transformers" else "1")
    dtype = torch.float64
    if path == "plan":
        monkeypatch.setattr(prepack, "lean_backend", lambda model: "cuda")
        dtype = torch.float32
    if path == "lean":
        dtype = torch.float32
    model = _model(dtype=dtype, seed=3, head_dim=64 if path == "plan" else 16)
    ids = torch.randint(0, VOCAB, (3, 19), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :12] = 0
    monkeypatch.setenv("JACOBI_EXT_PREFILL_CHUNK", "0")
    ar = generate(model, ids, attention_mask=mask, max_new_tokens=40, method="ar").tokens
    monkeypatch.setenv("JACOBI_EXT_PREFILL_CHUNK", "8")
    model.__dict__.pop("_jacobi_runtime", None)  # (a chunk size is a runtime's, at its making)
    for name, kw in METHODS.items():
        got = generate(model, ids, attention_mask=mask, max_new_tokens=40, **kw).tokens
        assert model._jacobi_runtime.prefill_chunk == 8, name
        assert torch.equal(got, ar), name


def test_the_chunk_setting():
    """CUDA graphs chunk the prefill by default; a CPU (no graphs) runs one pass; the variable
    sets it anywhere and is checked."""
    assert prefill_chunk("capture") == runtime.PREFILL_CHUNK > 0
    assert prefill_chunk("compile") == runtime.PREFILL_CHUNK
    assert prefill_chunk(None) == 0


def test_the_chunk_variable(monkeypatch):
    monkeypatch.setenv("JACOBI_EXT_PREFILL_CHUNK", "32")
    assert prefill_chunk(None) == 32
    monkeypatch.setenv("JACOBI_EXT_PREFILL_CHUNK", "0")
    assert prefill_chunk("capture") == 0
    for bad in ("-1", "many"):
        monkeypatch.setenv("JACOBI_EXT_PREFILL_CHUNK", bad)
        with pytest.raises(ValueError, match="JACOBI_EXT_PREFILL_CHUNK"):
            prefill_chunk(None)


def test_drafts_longer_than_a_chunk_run_in_one_pass(monkeypatch):
    """n + 1 > C: the drafts would not fit the last chunk; the prefill runs in one pass."""
    model = _model()
    ids, pad, drafts = _case(8, 2, 10, 6)
    ref = _prefill(model, monkeypatch, 0, ids, pad, drafts)
    calls = []
    real = runtime.StaticRuntime._prefill_chunked
    monkeypatch.setattr(runtime.StaticRuntime, "_prefill_chunked",
                        lambda *a, **k: calls.append(1) or real(*a, **k))  # fmt: skip
    got = _prefill(model, monkeypatch, 4, ids, pad, drafts)
    assert not calls
    _assert_same(got, ref, rtol=0, atol=0)
