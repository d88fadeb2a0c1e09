"""Batches and the static runtime: ragged left-padded prompts decoded together, one forward per
step, every sequence token for token what transformers' greedy gives for that prompt alone.
Tiny random float64 models (Llama and Qwen2), so the algorithm is what is tested."""

from __future__ import annotations

import random

import pytest
import torch

from jacobi_ext import generate
from jacobi_ext.decoding import left_pad, runtime
from jacobi_ext.models import tiny_llama

VOCAB = 64


def _hf_greedy(model, ids: list[int], max_new: int, eos: int | None) -> list[int]:
    x = torch.tensor([ids], device=next(model.parameters()).device)
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
        eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
    )[0, len(ids) :].tolist()  # fmt: skip
    if eos is not None and eos in out:
        out = out[: out.index(eos) + 1]
    return out


def _left_pad(prompts: list[list[int]], pad_value: int = 7):
    return left_pad(prompts, pad=pad_value)


@pytest.fixture(scope="module")
def models():
    return {
        fam: tiny_llama(vocab_size=VOCAB, seed=s, dtype=torch.float64, family=fam)
        for s, fam in enumerate(("llama", "qwen2"))
    }


@pytest.mark.parametrize("case", range(40))
def test_ragged_batch_is_lossless(models, case: int) -> None:
    rng = random.Random(1000 + case)
    model = models[rng.choice(["llama", "qwen2"])]
    B = rng.choice([2, 3, 5])
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 18))] for _ in range(B)]
    max_new = rng.randint(1, 60)
    eos = rng.choice([None, rng.randrange(VOCAB)])
    want = [_hf_greedy(model, p, max_new, eos) for p in prompts]
    ids, mask = _left_pad(prompts)
    method = rng.choice(["ar", "jacobi", "multiblock"])
    kw = {} if method == "ar" else dict(block_size=rng.choice([2, 4, 7]))
    if method == "multiblock":
        kw.update(num_blocks=rng.randint(1, 3), pool_size=rng.choice([0, 2, 4]))
    res = generate(
        model, ids, max_new_tokens=max_new, method=method, eos_token_id=eos, attention_mask=mask,
        lookup=case % 2 == 0, seed=case, **kw,
    )  # fmt: skip
    for b in range(B):
        assert res.tokens[b, : res.lengths[b]].tolist() == want[b], (b, method, kw)
    # one forward per step for the whole batch: never more steps than the longest answer
    assert res.forwards <= max(len(w) for w in want)


def test_batch_rows_stop_at_their_own_eos(models) -> None:
    model = models["llama"]
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [11]]
    free = [_hf_greedy(model, p, 40, None) for p in prompts]
    eos = free[1][5]  # the second row reaches it at token 6 (maybe others earlier or never)
    want = [_hf_greedy(model, p, 40, eos) for p in prompts]
    assert len({len(w) for w in want}) > 1  # rows really stop at different lengths
    ids, mask = _left_pad(prompts)
    res = generate(model, ids, 40, method="multiblock", block_size=4, eos_token_id=eos,
                   attention_mask=mask, pad_token_id=0)  # fmt: skip
    assert res.lengths == [len(w) for w in want]
    for b, w in enumerate(want):
        assert res.tokens[b].tolist() == w + [0] * (res.tokens.shape[1] - len(w))


def test_batch_equals_one_at_a_time_and_reuses_the_runtime(models) -> None:
    model = models["qwen2"]
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8], [6, 6]]
    ids, mask = _left_pad(prompts)
    together = generate(model, ids, 30, method="jacobi", block_size=5, attention_mask=mask)
    rt = model._jacobi_runtime
    again = generate(model, ids, 30, method="jacobi", block_size=5, attention_mask=mask)
    assert model._jacobi_runtime is rt  # same shapes: the runtime (and its graphs) is reused
    assert again.tokens.tolist() == together.tokens.tolist()
    for b, p in enumerate(prompts):
        alone = generate(model, torch.tensor([p]), 30, method="jacobi", block_size=5)
        assert together.tokens[b, : together.lengths[b]].tolist() == alone.tokens[0].tolist()


def test_batch_bad_inputs(models) -> None:
    model = models["llama"]
    ids, mask = _left_pad([[1, 2, 3], [4, 5]])
    with pytest.raises(ValueError, match="shape of input_ids"):
        generate(model, ids, 5, attention_mask=mask[:, 1:])
    right = mask.flip(1)
    with pytest.raises(ValueError, match="left"):
        generate(model, ids, 5, attention_mask=right)
    with pytest.raises(ValueError, match="all padding"):
        generate(model, ids, 5, attention_mask=torch.zeros_like(mask))
    with pytest.raises(ValueError, match="only 0"):
        generate(model, ids, 5, attention_mask=mask * 2)
    with pytest.raises(ValueError, match="context"):
        generate(model, ids, 5000, method="ar")


def test_sliding_window_models_are_refused() -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=8,
        max_window_layers=0, layer_types=["sliding_attention"] * 2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(ValueError, match="full-attention"):
        generate(model, torch.tensor([[1, 2, 3]]), 4, method="ar")


def test_buckets_and_masks() -> None:
    assert [runtime.bucket(q) for q in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    from jacobi_ext.decoding.masks import step_mask

    # two sequences; scratch of 4 slots; committed slots [4+lo, hi)
    seg = torch.tensor([[0, 0, 1, 1], [0, -1, -1, -1]])
    off = torch.tensor([[0, 1, 0, 1], [0, 0, 0, 0]])
    lo, hi = torch.tensor([4, 6]), torch.tensor([7, 8])
    m = step_mask(seg, off, lo, hi, 9)[:, 0].int()
    assert m[0].tolist() == [
        [1, 0, 0, 0, 1, 1, 1, 0, 0],  # main row token 0: itself + committed 4..6
        [1, 1, 0, 0, 1, 1, 1, 0, 0],
        [0, 0, 1, 0, 1, 1, 1, 0, 0],  # a candidate row never sees the main row
        [0, 0, 1, 1, 1, 1, 1, 0, 0],
    ]
    assert m[1].tolist()[0] == [1, 0, 0, 0, 0, 0, 1, 1, 0]
    assert m[1].tolist()[2] == [0, 0, 1, 0, 0, 0, 0, 0, 0]  # padding sees itself only
    native = torch.ops.jacobi_ext.cpu_step_mask(seg, off, lo, hi, 9)
    assert torch.equal(native, step_mask(seg, off, lo, hi, 9))


@pytest.mark.parametrize("seed", range(8))
def test_native_ar_acceptance_is_the_steps(seed: int) -> None:
    """The step's AR rows (the ar_accept op, jacobi/step_row.h: the one AR acceptance) against
    the rule restated in plain Python (reference.ar_step_row) on random steps: drafts that match
    their targets for a while, EOS anywhere (fed or not), sequences that feed nothing, with and
    without EOS ids, rows wider than the step."""
    from jacobi_ext.decoding.reference import ar_step_row

    g = torch.Generator().manual_seed(seed)
    B, Q = 1 + seed % 4, 1 + 2 * seed
    tgt = torch.randint(0, 6, (B, Q), generator=g)
    toks = torch.randint(0, 6, (B, Q), generator=g)
    run = torch.randint(0, Q + 1, (B,), generator=g)
    for b in range(B):  # drafts equal to the previous target up to a random point
        toks[b, 1 : run[b]] = tgt[b, : max(int(run[b]) - 1, 0)]
    fed = torch.randint(0, Q + 1, (B,), generator=g)
    S, tail = Q + seed % 3, seed
    for eos in (None, torch.tensor([2]), torch.tensor([0, 5])):
        ids = set() if eos is None else set(eos.tolist())
        want = [
            ar_step_row(toks[b].tolist(), tgt[b].tolist(), int(fed[b]), ids, S, tail)
            for b in range(B)
        ]
        rows, count = torch.ops.jacobi_ext.ar_accept(toks, tgt, fed, eos, S, tail)
        assert rows.tolist() == [r for r, _ in want], eos
        assert count.tolist() == [c for _, c in want], eos
    # the torch statement the step runs where the op has no kernel for the device
    from types import SimpleNamespace

    from jacobi_ext.decoding.step import BatchStep
    from jacobi_ext.decoding.step_row import row_layout

    for eos in (None, torch.tensor([2]), torch.tensor([0, 5])):
        bs = SimpleNamespace(eos=eos, S=S, layout=row_layout(S, tail, 0, 0, 0))
        want = torch.ops.jacobi_ext.ar_accept(toks, tgt, fed, eos, S, tail)
        got = BatchStep._ar_rows_reference(bs, toks, tgt, fed, Q)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), eos
    with pytest.raises(ValueError, match="fed must be"):
        torch.ops.jacobi_ext.ar_accept(toks, tgt, fed[:0], None, S, tail)
    with pytest.raises(ValueError, match="must hold"):
        torch.ops.jacobi_ext.ar_accept(toks, tgt, fed, None, Q - 1, tail)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
def test_ar_acceptance_on_cuda_is_the_cpus(seed: int) -> None:
    """ar_accept's CUDA kernel (the same jacobi/step_row.h function, one thread a sequence)
    gives the CPU op's rows and counts, on random steps with and without EOS ids."""
    g = torch.Generator().manual_seed(seed)
    B, Q = 1 + seed, 1 + 3 * seed
    tgt = torch.randint(0, 6, (B, Q), generator=g)
    toks = torch.randint(0, 6, (B, Q), generator=g)
    for b in range(B):
        run = int(torch.randint(0, Q + 1, (1,), generator=g))
        toks[b, 1:run] = tgt[b, : max(run - 1, 0)]
    fed = torch.randint(0, Q + 1, (B,), generator=g)
    for eos in (None, torch.tensor([2]), torch.tensor([0, 5])):
        want = torch.ops.jacobi_ext.ar_accept(toks, tgt, fed, eos, Q + 2, 5)
        cuda = [t.cuda() if t is not None else None for t in (toks, tgt, fed, eos)]
        got = torch.ops.jacobi_ext.ar_accept(*cuda, Q + 2, 5)
        for a, w in zip(got, want, strict=True):
            assert a.is_cuda and torch.equal(a.cpu(), w)


@pytest.mark.parametrize("seed", range(6))
def test_native_step_mask_is_step_mask(seed: int) -> None:
    """The CPU runtime's one-pass mask (cpu_step_mask) against masks.step_mask on random steps:
    packed rows of random lengths, padding, any committed range, widths past the scratch."""
    from jacobi_ext.decoding.masks import step_mask

    g = torch.Generator().manual_seed(seed)
    B, Q = 1 + seed % 3, 1 + 3 * seed
    seg, off = torch.full((B, Q), -1), torch.zeros(B, Q, dtype=torch.long)
    for b in range(B):
        i, r = 0, 0
        fill = int(torch.randint(0, Q + 1, (1,), generator=g))
        while i < fill:
            n = min(fill - i, int(torch.randint(1, 5, (1,), generator=g)))
            seg[b, i : i + n], off[b, i : i + n] = r, torch.arange(n)
            i, r = i + n, r + 1
    width = Q + int(torch.randint(0, 40, (1,), generator=g))
    lo = torch.randint(Q, width + 1, (B,), generator=g)
    hi = torch.minimum(lo + torch.randint(0, 30, (B,), generator=g), torch.tensor(width))
    got = torch.ops.jacobi_ext.cpu_step_mask(seg, off, lo, hi, width)
    assert torch.equal(got, step_mask(seg, off, lo, hi, width))
    with pytest.raises(ValueError, match="must cover"):
        torch.ops.jacobi_ext.cpu_step_mask(seg, off, lo, hi, Q - 1)


@pytest.mark.gpu
@pytest.mark.gpu_timeout(180)  # captures CUDA graphs
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_graph_runtime_is_lossless(graphs: bool) -> None:
    """On a GPU, graph replay (every bucket captured once, reused across calls) and eager give
    greedy's tokens, batch 1 and a ragged batch, fp32."""
    model = tiny_llama(vocab_size=VOCAB, seed=5, dtype=torch.float32).cuda()
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 20))] for _ in range(4)]
    want = [_hf_greedy(model, p, 48, None) for p in prompts]
    for kw in (
        dict(method="ar"),
        dict(method="ar", lookup=True),
        dict(method="jacobi", block_size=8),
        dict(method="multiblock", block_size=8, num_blocks=3, pool_size=4),
    ):
        one = generate(model, torch.tensor([prompts[0]]).cuda(), 48, cuda_graphs=graphs, **kw)
        assert one.tokens[0].tolist() == want[0], kw
        assert (one.graph_replays > 0) == graphs
        ids, mask = _left_pad(prompts)
        res = generate(model, ids.cuda(), 48, attention_mask=mask.cuda(), cuda_graphs=graphs, **kw)
        for b in range(4):
            assert res.tokens[b, : res.lengths[b]].tolist() == want[b], (b, kw)


def test_bucket_padding_is_lossless_on_cpu(models, monkeypatch) -> None:
    """The GPU path pads every step to a power-of-two width (graph buckets); the padding
    queries must change nothing. Forced here on CPU, where it is otherwise off."""
    monkeypatch.setattr(runtime.StaticRuntime, "width", lambda self, q: runtime.bucket(q))
    model = models["qwen2"]
    prompts = [[5, 1, 5, 1, 9], [3, 3, 2, 8, 4, 4, 4, 1, 6]]
    want = [_hf_greedy(model, p, 40, None) for p in prompts]
    ids, mask = _left_pad(prompts)
    for kw in (dict(method="ar", lookup=True), dict(method="multiblock", block_size=5)):
        model.__dict__.pop("_jacobi_runtime", None)
        res = generate(model, ids, 40, attention_mask=mask, **kw)
        for b in range(2):
            assert res.tokens[b, : res.lengths[b]].tolist() == want[b], kw


def test_left_pad_right_aligns_prompts_and_says_what_it_takes() -> None:
    """The library's batch builder: lists or 1-D tensors, each right-aligned behind `pad`, the mask
    1 on tokens only; a [1, L] tensor or an empty prompt is refused with what to pass instead."""
    ids, mask = left_pad([[1, 2, 3], torch.tensor([4, 5]), [6]], pad=9)
    assert ids.tolist() == [[1, 2, 3], [9, 4, 5], [9, 9, 6]]
    assert mask.tolist() == [[1, 1, 1], [0, 1, 1], [0, 0, 1]]
    assert ids.dtype == mask.dtype == torch.long
    with pytest.raises(ValueError, match=r"ids\[0\]"):
        left_pad([torch.tensor([[1, 2]])])
    with pytest.raises(ValueError, match="non-empty"):
        left_pad([[1], []])
    with pytest.raises(ValueError, match="at least one"):
        left_pad([])


def test_ar_steps_without_the_op_kernel_decode_the_same(monkeypatch) -> None:
    """Where the build has no ar_accept kernel for the device (a GPU without our CUDA build),
    the step takes the AR rows' torch statement: the same tokens, a batch of AR sequences with
    lookup drafts."""
    from jacobi_ext.decoding import step

    model = tiny_llama(vocab_size=VOCAB, seed=3, dtype=torch.float64)
    ids = torch.tensor([[5, 9, 2, 7, 5, 9, 2, 7], [0, 0, 4, 8, 6, 4, 8, 6]])
    mask = (ids != 0).long()
    want = generate(model, ids, 24, attention_mask=mask, method="ar", lookup=True).tokens
    real = step.has_kernel
    monkeypatch.setattr(step, "has_kernel", lambda op, dev: op != "ar_accept" and real(op, dev))
    calls, ref = [], step.BatchStep._ar_rows_reference
    monkeypatch.setattr(
        step.BatchStep, "_ar_rows_reference", lambda s, *a: calls.append(1) or ref(s, *a)
    )
    if hasattr(model, "_jacobi_runtime"):
        del model._jacobi_runtime  # (a new runtime, new BatchSteps)
    got = generate(model, ids, 24, attention_mask=mask, method="ar", lookup=True).tokens
    assert torch.equal(got, want) and len(calls) > 5
