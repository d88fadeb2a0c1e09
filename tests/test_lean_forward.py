"""Decoding through our CPU linear kernel (fp32 and bf16): the lean forward
(jacobi_ext/decoding/lean.py) gives bitwise the logits of transformers' forward with the kernel
behind every nn.Linear, and every method returns exactly our AR's tokens. (The float64 suites,
test_decoding_lossless.py and test_decoding_batch.py, run on F.linear; these are the fp32/bf16
runs on the kernel that decoding uses by default on a CPU.)"""

from types import SimpleNamespace

import pytest
import torch

from jacobi_ext.decoding import lean, prepack
from jacobi_ext.decoding.engine import generate
from jacobi_ext.decoding.runtime import StaticRuntime
from jacobi_ext.models import tiny_llama

DTYPES = [torch.float32, torch.bfloat16]
MODELS = [("llama", "sdpa"), ("qwen2", "sdpa"), ("qwen3", "sdpa"), ("llama", "eager")]


def _model(family, attn, dtype, seed=0):
    m = tiny_llama(
        vocab_size=101, hidden_size=96, num_layers=2, num_heads=6, num_kv_heads=2, seed=seed,
        family=family, attn_implementation=attn,
    )  # fmt: skip
    if family == "qwen2":  # Qwen2 has q/k/v biases: make them count
        with torch.no_grad():
            for layer in m.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 1)
    return m.to(dtype)


def _logits(model, lean_env, monkeypatch, ids, pad, drafts, fused="0"):
    """Logits of a prefill (prompts + drafts) and of one step after it, from a fresh runtime."""
    monkeypatch.setenv("JACOBI_EXT_LEAN", lean_env)
    monkeypatch.setenv("JACOBI_EXT_FUSED", fused)
    B = ids.shape[0]
    rt = StaticRuntime(model, B, 64, 16)
    keep = lambda logits, pos: logits.clone()  # noqa: E731  (the rule sees the raw logits)
    pre = rt.prefill(ids, pad, drafts, rule=keep, all_targets=True)
    assert bool(rt._lean) == (lean_env == "1")  # the path under test is the one that ran
    q = 5
    with torch.inference_mode():
        rt.ids[:, :q] = torch.arange(q)[None] + 7
        rt.seg[:, :q] = 0
        rt.off[:, :q] = torch.arange(q)[None]
        step = rt.forward(q, rt.scratch + ids.shape[1], rule=keep)
    return pre, step


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family,attn", MODELS)
def test_lean_logits_match_transformers_forward(family, attn, dtype, monkeypatch):
    """With the model's own attention and norms (JACOBI_EXT_FUSED=0) the lean forward is
    transformers' forward bit for bit; with our fused attention and RMSNorm, to rounding."""
    model = _model(family, attn, dtype)
    assert lean.why_not(model) is None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (2, 11), generator=g)
    pad = torch.tensor([0, 3])  # the second prompt is left-padded
    drafts = torch.randint(0, 101, (2, 4), generator=g)
    pre_hf, step_hf = _logits(model, "0", monkeypatch, ids, pad, drafts)
    pre_lean, step_lean = _logits(model, "1", monkeypatch, ids, pad, drafts)
    assert torch.equal(pre_lean, pre_hf)
    assert torch.equal(step_lean, step_hf)
    pre_fused, step_fused = _logits(model, "1", monkeypatch, ids, pad, drafts, fused="1")
    tol = dict(rtol=0, atol=0.02 * float(pre_hf.abs().max())) if dtype == torch.bfloat16 else {}
    real = torch.ones_like(pre_hf[..., 0], dtype=torch.bool)
    real[1, :3] = False  # padding queries see only themselves: their logits are not used
    torch.testing.assert_close(pre_fused[real], pre_hf[real], **tol)
    torch.testing.assert_close(step_fused, step_hf, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 48])
def test_rotary_tables_are_the_models_rotary_bitwise(dtype, head_dim):
    """The lean forward's cos / sin rows (tables made once, in pieces) are bitwise the model's
    rotary embedding called on a step's positions, for every position of a long cache and for
    steps of several sequences and tokens; a head size off 32 lanes calls the model's."""
    model = tiny_llama(
        vocab_size=101, hidden_size=2 * head_dim, num_layers=1, num_heads=2, num_kv_heads=1,
    ).to(dtype)  # fmt: skip
    with torch.inference_mode():
        dec = lean.lean_decoder(model)
        rope = model.model.rotary_emb
        h = torch.zeros(1, 1, 2 * head_dim, dtype=dtype)
        n = 1100  # several pieces, not a multiple of one
        rt = SimpleNamespace(capacity=n, rope_tables={})  # (the runtime owns its tables)
        g = torch.Generator().manual_seed(0)
        for pos in [torch.arange(n)[:, None], torch.randint(0, n, (3, 17), generator=g)]:
            got = dec._cos_sin(h, pos, rt)
            want = rope.forward(h, pos)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == dtype and torch.equal(a, b)
        assert (not rt.rope_tables) == (head_dim % 32 != 0)


@pytest.mark.parametrize("lean_env,fused", [("0", "0"), ("1", "0"), ("1", "1")])
@pytest.mark.parametrize("n", [0, 4])
def test_prefill_heads_only_the_positions_decoding_reads(lean_env, fused, n, monkeypatch):
    """A prefill returns the targets of the prompt's last token and of the drafts alone (the LM
    head on those positions only): bitwise the tail of the targets over every position, through
    transformers' forward (logits_to_keep), the lean forward and the fused one."""
    monkeypatch.setenv("JACOBI_EXT_LEAN", lean_env)
    monkeypatch.setenv("JACOBI_EXT_FUSED", fused)
    model = _model("qwen2", "sdpa", torch.float32, seed=6)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 101, (2, 11), generator=g)
    pad = torch.tensor([2, 0])
    drafts = torch.randint(0, 101, (2, n), generator=g) if n else None
    raw = lambda logits, pos: torch.cat([logits, pos[..., None].to(logits.dtype)], -1)  # noqa: E731
    got = {}
    for every in (True, False):
        rt = StaticRuntime(model, 2, 64, 16)
        got[every] = rt.prefill(ids, pad, drafts, rule=raw, all_targets=every)
        assert bool(rt._lean) == (lean_env == "1")
    assert got[True].shape[1] == 11 + n and got[False].shape[1] == n + 1
    assert torch.equal(got[False], got[True][:, 10:])  # logits and the positions the rule saw
    rt = StaticRuntime(model, 2, 64, 16)
    assert torch.equal(rt.prefill(ids, pad, drafts), got[True][:, 10:, :-1].argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_native_layer_loop_is_the_python_loop_bitwise(family, dtype, monkeypatch):
    """The fused ops run from C++ in one call (torch.classes.jacobi_ext.LeanLayers) give the
    bits of the same ops called one by one from Python, at prefill and at a step (Qwen2: with
    q/k/v biases); JACOBI_EXT_NATIVE=0 is the Python loop."""
    model = _model(family, "sdpa", dtype, seed=3)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 101, (2, 11), generator=g)
    pad = torch.tensor([0, 3])
    drafts = torch.randint(0, 101, (2, 4), generator=g)
    got = {}
    for native in ("1", "0"):
        monkeypatch.setenv("JACOBI_EXT_NATIVE", native)
        got[native] = _logits(model, "1", monkeypatch, ids, pad, drafts, fused="1")
        with torch.inference_mode():
            runs = lean.lean_decoder(model)
        assert (runs.native is not None) == (native == "1")  # the path under test ran
        if native == "1":
            assert runs.native.size() == 2
    for a, b in zip(got["1"], got["0"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_every_method_is_our_ar_on_the_kernel(family, dtype, monkeypatch):
    """Lossless where the linears run on our kernel (and attention and norms on our fused ops):
    jacobi, multiblock (with and without lookup drafts) and a batch give exactly our AR's
    tokens, greedy and sampled."""
    assert prepack.kernel_available()
    monkeypatch.setattr(prepack, "cpu_has_amx", lambda: False)  # the kernel, not a measurement
    model = _model(family, "sdpa", dtype, seed=4)
    assert prepack.backend(model) == "kernel"
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 101, (3, 9), generator=g)
    ar = generate(model, ids, max_new_tokens=48, method="ar").tokens
    runs = {
        "jacobi n=8": dict(method="jacobi", block_size=8, lookup=False),
        "jacobi n=16 lookup": dict(method="jacobi", block_size=16, lookup=True),
        "multiblock": dict(method="multiblock", block_size=4, num_blocks=3, pool_size=2),
    }
    for name, kw in runs.items():
        got = generate(model, ids, max_new_tokens=48, **kw).tokens
        assert torch.equal(got, ar), name
        one = generate(model, ids[1:2], max_new_tokens=48, **kw).tokens  # batch of one
        assert torch.equal(one[0, : one.shape[1]], ar[1, : one.shape[1]]), name
    # Sampling on the same fused path: every method draws exactly AR's sample for a seed.
    sample = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=3)
    want = generate(model, ids, max_new_tokens=48, method="ar", **sample).tokens
    assert not torch.equal(want, ar)  # (a sample, not the greedy answer)
    for name, kw in runs.items():
        got = generate(model, ids, max_new_tokens=48, **kw, **sample).tokens
        assert torch.equal(got, want), name
    # Without the fused ops the lean forward is transformers' (bitwise): the same tokens.
    monkeypatch.setenv("JACOBI_EXT_FUSED", "0")
    unfused = generate(model, ids, max_new_tokens=48, method="ar").tokens
    monkeypatch.setenv("JACOBI_EXT_LEAN", "0")
    assert torch.equal(generate(model, ids, max_new_tokens=48, method="ar").tokens, unfused)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lookup", [False, True])
def test_ar_steps_written_in_place_are_the_scratch_steps_bitwise(dtype, lookup, monkeypatch):
    """One sequence's AR steps write their K/V right after the committed tokens (where those
    accepted stay: the commit moves nothing); every forward's logits are bitwise those of the
    same steps written to scratch and moved, with and without lookup drafts (several rows a
    step, some rejected and overwritten by the next), whether the step runs from lists
    (step.BatchStep.ar_row, the greedy default) or as the batch step (sampling's way)."""
    from jacobi_ext.decoding import runtime, step, tuning

    monkeypatch.setattr(prepack, "cpu_has_amx", lambda: False)
    model = _model("llama", "sdpa", dtype, seed=5)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 101, (1, 12), generator=g)
    prompt[0, 6:] = prompt[0, :6]  # repeats: lookup drafts to verify
    got, moved, listed = {}, [], []
    head = lean.LeanDecoder._head

    def recorded(self, x, keep, greedy=False):
        out = head(self, x, keep, greedy)
        got[mode].append(out.clone())
        return out

    commit, ar_row = runtime.StaticRuntime.commit, step.BatchStep.ar_row

    def counted(self, src, count, in_place=False):
        moved.append(not in_place)
        return commit(self, src, count, in_place)

    # the same drafts in both runs: the lookup's pricing learns nothing from the first
    monkeypatch.setattr(tuning.Tuner, "observe", lambda self, *args, **kwargs: None)
    generate(model, prompt, max_new_tokens=4, method="ar", lookup=lookup)  # (its curve, once)
    monkeypatch.setattr(lean.LeanDecoder, "_head", recorded)
    monkeypatch.setattr(runtime.StaticRuntime, "commit", counted)
    monkeypatch.setattr(step.BatchStep, "ar_row", lambda s, *a: listed.append(1) or ar_row(s, *a))
    tokens = {}
    for mode in ("lists", "in place", "scratch"):
        if mode == "in place":
            monkeypatch.setattr(step.BatchStep, "ar_fast", lambda self: False)
        if mode == "scratch":
            monkeypatch.setattr(runtime.StaticRuntime, "writes_in_place", lambda self: False)
        got[mode], moved[:], listed[:] = [], [], []
        out = generate(model, prompt, max_new_tokens=40, method="ar", lookup=lookup)
        tokens[mode] = out.tokens
        if mode == "lists":  # in place too: ar_row's commit (the one commit) moves nothing
            assert len(listed) == out.forwards == len(moved) and not any(moved)
        else:
            assert not listed and moved and all(m == (mode == "scratch") for m in moved), mode
        # fewer forwards than tokens (drafts accepted) exactly where drafts were fed
        assert (out.forwards < out.new_tokens - 1) == lookup
    assert torch.equal(tokens["lists"], tokens["scratch"])
    assert torch.equal(tokens["in place"], tokens["scratch"])
    assert len(got["lists"]) == len(got["in place"]) == len(got["scratch"]) > 10
    for a, b in zip(got["lists"], got["scratch"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(got["in place"], got["scratch"], strict=True):
        assert torch.equal(a, b)


def test_weights_changed_between_calls_are_repacked():
    model = _model("llama", "sdpa", torch.float32)
    ids = torch.randint(0, 101, (1, 6), generator=torch.Generator().manual_seed(3))
    before = generate(model, ids, max_new_tokens=12, method="ar").tokens
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)  # in place: a new version
        model.lm_head.weight.copy_(torch.roll(model.lm_head.weight, 1, dims=0))
    after = generate(model, ids, max_new_tokens=12, method="ar").tokens
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)[:, ids.shape[1] :]
    assert not torch.equal(before, after)
    assert torch.equal(after[0, :2], plain[0, :2])  # the model's own greedy: the new weights


def test_where_it_does_not_apply(monkeypatch):
    """Other models, dtypes or switches run transformers' forward, with a reason."""
    assert lean.why_not(tiny_llama().to(torch.float64)).startswith("its linears do not run")
    m = tiny_llama()
    m.model.layers[0].self_attn.q_norm = torch.nn.Identity()  # a Qwen3-like extra module
    assert "normalises q/k" in lean.why_not(m)
    monkeypatch.setenv("JACOBI_EXT_LEAN", "0")
    assert lean.why_not(tiny_llama()) == "JACOBI_EXT_LEAN=0"
    assert lean.lean_decoder(tiny_llama()) is None


def test_weights_rewritten_through_data_are_repacked():
    """Merging a LoRA adapter writes the base weights through `.data`, which bumps no version
    counter: the packed copies still follow (the slow overfit test decodes before and after
    training on one model object)."""
    model = _model("llama", "sdpa", torch.float32)
    ids = torch.randint(0, 101, (1, 6), generator=torch.Generator().manual_seed(5))
    before = generate(model, ids, max_new_tokens=12, method="ar").tokens
    with torch.no_grad():
        model.lm_head.weight.data.mul_(-1.0)
        model.model.layers[0].mlp.down_proj.weight.data.mul_(3.0)
    after = generate(model, ids, max_new_tokens=12, method="ar").tokens
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)[:, ids.shape[1] :]
    assert not torch.equal(before, after)
    assert torch.equal(after[0, :3], plain[0, :3])
