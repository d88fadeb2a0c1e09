"""The device step of a batch (jacobi_ext/decoding/step.py): one verify launch per step for all
sequences, no host value read inside the step (what lets CUDA capture it as one graph), and
neutral inputs that change nothing (what the warm-up before a capture runs on)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from jacobi_ext import generate
from jacobi_ext.decoding import step
from jacobi_ext.models import tiny_llama

VOCAB = 64
IDS = torch.tensor([[5, 9, 2, 7, 1, 3, 5, 9], [0, 0, 0, 4, 8, 6, 2, 4], [0, 11, 3, 3, 3, 7, 1, 1]])
MASK = (torch.arange(8)[None, :] >= torch.tensor([0, 3, 1])[:, None]).long()


@pytest.fixture(scope="module")
def models():
    return [
        tiny_llama(vocab_size=VOCAB, seed=s, dtype=torch.float64, family=fam)
        for s, fam in enumerate(("llama", "qwen2"))
    ]


def _count_launches(monkeypatch) -> list[int]:
    """The verify op's launches (on a CPU inside verify_rows, one each)."""
    calls: list[int] = []
    for name in ("verify", "verify_rows"):
        real = getattr(step, name)

        def counted(*args, real=real):
            calls.append(args[0].shape[0])  # the batch of this launch
            return real(*args)

        monkeypatch.setattr(step, name, counted)
    return calls


@pytest.mark.parametrize("kw", [
    dict(method="jacobi", block_size=4),
    dict(method="multiblock", block_size=5, num_blocks=3, pool_size=3),
    dict(method="multiblock", block_size=3, lookup=True),
])  # fmt: skip
def test_one_verify_launch_per_step_for_the_whole_batch(models, monkeypatch, kw) -> None:
    calls = _count_launches(monkeypatch)
    for model in models:
        calls.clear()
        res = generate(model, IDS, 40, attention_mask=MASK, **kw)
        assert len(calls) == res.forwards  # one launch per step, not one per sequence
        assert set(calls) == {IDS.shape[0]}  # each launch covers the whole batch


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kw", [
    dict(method="jacobi", block_size=4),
    dict(method="multiblock", block_size=5, num_blocks=3, pool_size=3),
    dict(method="multiblock", block_size=3, lookup=True, eos_token_id=[3, 7]),
])  # fmt: skip
def test_native_verify_rows_are_the_tensor_ops(models, monkeypatch, kw, device) -> None:
    """The verify side of a step is one op (verify_rows, jacobi/verify_rows.h; on CUDA one
    kernel): at every step of a batch (sequences that finish early, take part or not, AR
    fallbacks), its packed rows, winner offsets, counts and flags, and every state it updates
    (next rows and candidates, block ends, pool, context), equal the tensor ops' on the same
    inputs (BatchStep._verify_reference)."""
    real = step.BatchStep._verify
    checked = []

    def both(self, toks, tgt, Q):
        kept = lambda: [  # noqa: E731
            self.src, self.block_ends, self.pool, self.pool_len, self.pool_head,
            self.ctx[:, : self.ctx_cap], self.ctx_len,
        ]  # fmt: skip
        before = [t.clone() for t in kept()]
        self._native_verify = False
        want = real(self, toks, tgt, Q)
        want_state = [t.clone() for t in kept()]
        for t, b in zip(kept(), before, strict=True):
            t.copy_(b)
        self._native_verify = True
        got = real(self, toks, tgt, Q)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
        for a, b in zip(kept(), want_state, strict=True):
            assert torch.equal(a, b)
        checked.append(1)
        return got

    monkeypatch.setattr(step.BatchStep, "_verify", both)
    for model in models:  # (eager on CUDA: the comparison reads the device)
        model = copy.deepcopy(model).to(device)  # (the module's models stay on the CPU)
        res = generate(model, IDS.to(device), 40, attention_mask=MASK.to(device),
                       cuda_graphs=False, **kw)  # fmt: skip
        assert res.tokens.shape[0] == IDS.shape[0]
    assert len(checked) > 10


def test_ar_steps_launch_no_verify(models, monkeypatch) -> None:
    calls = _count_launches(monkeypatch)
    res = generate(models[0], IDS, 30, attention_mask=MASK, method="ar", lookup=True)
    assert calls == [] and res.forwards > 0


class _NoHostReads(TorchDispatchMode):
    """Fails on the ops that bring a device value to the host (.item(), bool(), data-dependent
    shapes); a CUDA graph capture would fail on them, or bake one step's value into every
    replay."""

    READS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "item", "masked_select"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.READS:
            raise AssertionError(f"the device step reads a host value: aten.{name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kw", [
    dict(method="ar", lookup=True),
    dict(method="jacobi", block_size=4),
    dict(method="multiblock", block_size=4, num_blocks=2, pool_size=2),
])  # fmt: skip
def test_the_step_reads_no_host_value(models, monkeypatch, kw) -> None:
    # On CPU, where no graph is captured, the step runs under a dispatch mode that fails on any
    # device -> host read, and .tolist() (which does not dispatch) is forbidden inside it.
    real = step.BatchStep._step
    steps = []

    def guarded(self, Q, attend, *mix):
        def no_tolist(*a, **k):
            raise AssertionError("the device step reads a host value: .tolist()")

        with monkeypatch.context() as mp, _NoHostReads():
            mp.setattr(torch.Tensor, "tolist", no_tolist)
            out = real(self, Q, attend, *mix)
        steps.append(Q)
        return out

    monkeypatch.setattr(step.BatchStep, "_step", guarded)
    for model in models:
        res = generate(model, IDS, 30, attention_mask=MASK, **kw)
        assert res.tokens.shape[0] == IDS.shape[0]
    assert steps  # the guard ran


def test_neutral_inputs_change_nothing(models) -> None:
    # The warm-up before a capture runs the step for real on all-zero inputs: no state may move.
    model = models[1]
    model.__dict__.pop("_jacobi_runtime", None)
    generate(model, IDS, 20, attention_mask=MASK, method="multiblock", block_size=4)
    rt = model._jacobi_runtime
    (bs,) = rt.batch_steps.values()
    state = dict(
        main=bs.src[:, : bs.host0], block_ends=bs.block_ends, pool=bs.pool,
        pool_len=bs.pool_len, pool_head=bs.pool_head, ctx=bs.ctx[:, : bs.ctx_cap],
        ctx_len=bs.ctx_len, hi=rt.hi, lo=rt.lo,
    )  # fmt: skip
    state["kv"] = torch.stack([layer.keys[:, :, rt.scratch :] for layer in rt.cache.layers])
    before = {k: v.clone() for k, v in state.items()}
    with torch.inference_mode():
        bs.inputs.zero_()
        bs._step(4, rt.capacity)
    state["kv"] = torch.stack([layer.keys[:, :, rt.scratch :] for layer in rt.cache.layers])
    for k, v in before.items():
        assert torch.equal(state[k], v), k


@pytest.mark.gpu
@pytest.mark.gpu_timeout(180)  # captures CUDA graphs
def test_the_whole_step_is_one_graph_replay() -> None:
    """On a GPU: every step of a ragged batch is one replay of a captured step graph (forward,
    verify, K/V commit, next drafts), and the tokens are greedy's."""
    model = tiny_llama(vocab_size=VOCAB, seed=5, dtype=torch.float32).cuda()
    for kw in (dict(method="ar", lookup=True), dict(method="multiblock", block_size=6)):
        model.__dict__.pop("_jacobi_runtime", None)
        eager = generate(model, IDS.cuda(), 40, attention_mask=MASK.cuda(), cuda_graphs=False, **kw)
        res = generate(model, IDS.cuda(), 40, attention_mask=MASK.cuda(), cuda_graphs=True, **kw)
        assert res.tokens.tolist() == eager.tokens.tolist(), kw
        assert res.graph_replays == res.forwards, kw
        keys = model._jacobi_runtime._graphs.keys()
        assert keys and all(k[0] == "step" for k in keys), list(keys)


# ---- the compiled variant of the step (torch.compile reduce-overhead, next to direct capture) --


def test_graph_mode_is_selectable(models, monkeypatch) -> None:
    from jacobi_ext.decoding.graphs import graphs_wanted as _graphs_wanted

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _graphs_wanted(cuda, None) == "capture"  # the default stays direct capture
    assert _graphs_wanted(cuda, True) == "capture" and _graphs_wanted(cuda, False) is None
    assert _graphs_wanted(cuda, "compile") == "compile"
    assert _graphs_wanted(cpu, "compile") is None  # CPU steps always run eagerly
    monkeypatch.setenv("JACOBI_EXT_CUDA_GRAPHS", "compile")
    assert _graphs_wanted(cuda, None) == "compile"
    monkeypatch.setenv("JACOBI_EXT_CUDA_GRAPHS", "0")
    assert _graphs_wanted(cuda, None) is None
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        generate(models[0], IDS, 4, attention_mask=MASK, cuda_graphs="fast")
    kw = dict(attention_mask=MASK, method="multiblock", block_size=4)
    want = generate(models[0], IDS, 12, **kw).tokens
    assert torch.equal(generate(models[0], IDS, 12, cuda_graphs="compile", **kw).tokens, want)


def test_the_step_traces_as_one_graph(models, monkeypatch) -> None:
    # What torch.compile(mode="reduce-overhead") needs to make the step one CUDA graph: dynamo
    # traces the whole step (forward, verify op through its fake, commit, next drafts) without
    # a graph break. Checked on CPU with the eager backend (no code generation), against eager.
    model = models[0]
    kw = dict(attention_mask=MASK, method="multiblock", block_size=4, pool_size=2)
    want = generate(model, IDS, 12, **kw).tokens
    real = step.BatchStep._step
    compiled = {}

    def traced(self, Q, attend, mix):
        if (Q, mix) not in compiled:
            fn = lambda: real(self, Q, self.rt.capacity, mix)  # noqa: E731  (as graphs attend)
            compiled[Q, mix] = torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)
        return compiled[Q, mix]()

    monkeypatch.setattr(step.BatchStep, "_step", traced)
    model.__dict__.pop("_jacobi_runtime", None)
    assert torch.equal(generate(model, IDS, 12, **kw).tokens, want)
    assert compiled
    model.__dict__.pop("_jacobi_runtime", None)


@pytest.mark.gpu
@pytest.mark.gpu_timeout(300)  # torch.compile
def test_compiled_step_is_lossless_on_cuda() -> None:
    model = tiny_llama(vocab_size=VOCAB, seed=6, dtype=torch.float32).cuda()
    for kw in (dict(method="ar"), dict(method="multiblock", block_size=6)):
        model.__dict__.pop("_jacobi_runtime", None)
        eager = generate(model, IDS.cuda(), 40, attention_mask=MASK.cuda(), cuda_graphs=False, **kw)
        res = generate(
            model, IDS.cuda(), 40, attention_mask=MASK.cuda(), cuda_graphs="compile", **kw
        )
        assert res.tokens.tolist() == eager.tokens.tolist(), kw
        assert res.warmup_seconds > 0, kw  # the compile, reported apart from the steps
