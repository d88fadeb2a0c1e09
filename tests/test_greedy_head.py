"""The exact mode's greedy LM head: torch.ops.jacobi_ext.cpu_linear_gguf_greedy
(csrc/include/jacobi/greedy_screen.h) returns bitwise the argmax of the exact product,
argmax(cpu_linear_gguf(x, ...)), found through an 8-bit product and an error bound.

What could break it, and is checked here on weights the tests write with the `gguf` package:
- the bound: near-ties (columns one code apart), exact ties (duplicate columns, in one panel and
  in different panels), scales with subnormals, outliers in x, many rows at once;
- the rows it cannot screen: NaN, inf, zeros, values whose products leave fp32's range, more
  candidates than the cap, each beside ordinary rows in the same call;
- every ISA variant (its 8-bit tile and its exact tile), one and two threads;
- the decoding: the greedy head is used where the head is an exact Q4_1 / Q8_0 GGUF linear, and
  every method returns the tokens it returns without it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from jacobi_ext.kernels._native import ops

sys.path.insert(0, str(Path(__file__).parent))
from conftest import ISAS  # noqa: E402
from gguf_fixtures import random_rows, tiny_config, write_tiny_model  # noqa: E402

TYPES = (Q.Q8_0, Q.Q4_1)


def _weight(raw: np.ndarray, qtype: Q):
    """(packed, abs_sums, dequantized float64 [N, K]) of raw rows as the file stores them."""
    N = raw.shape[0]
    packed = ops.cpu_linear_gguf_pack([torch.from_numpy(np.ascontiguousarray(raw))], int(qtype))
    w = torch.from_numpy(np.array(quants.dequantize(raw, qtype), np.float64)).reshape(N, -1)
    sums = ops.cpu_linear_gguf_abs_sums(packed, int(qtype), N, w.shape[1])
    return packed, sums, w


def _check(x: torch.Tensor, raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """The greedy op against the argmax of the exact product, for x [..., K]."""
    packed, sums, _ = _weight(raw, qtype)
    N = raw.shape[0]
    got = ops.cpu_linear_gguf_greedy(x, packed, int(qtype), N, sums)
    want = ops.argmax(ops.cpu_linear_gguf(x, packed, int(qtype), N))
    assert got.shape == x.shape[:-1] and got.dtype == torch.long
    assert torch.equal(got, want), (got, want)
    return got


def _near_ties(qtype: Q, N: int, K: int, rng) -> np.ndarray:
    """N rows that are one row with one code moved by one (its logits a few ulps to a few units
    apart): most of them candidates, some rows over the cap."""
    base = random_rows(qtype, 1, K, rng, scale=0.05)
    raw = np.repeat(base, N, axis=0)
    bb = 34 if qtype == Q.Q8_0 else 20
    hdr = 2 if qtype == Q.Q8_0 else 4
    for n in range(1, N):
        b = int(rng.integers(0, K // 32))
        at = b * bb + hdr + int(rng.integers(0, 32 if qtype == Q.Q8_0 else 16))
        raw[n, at] = (int(raw[n, at]) + int(rng.choice([1, 255, 16, 240]))) % 256
    return raw


def _even_scales(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """raw with every block's scale 0.01 (and Q4_1's offset -0.075, its codes centred): rows of
    similar norms, so that x along a row makes that row the largest logit."""
    N, bb = raw.shape[0], 34 if qtype == Q.Q8_0 else 20
    blocks = raw.reshape(N, -1, bb)
    blocks[:, :, 0:2] = np.array([0.01], np.float16).view(np.uint8)
    if qtype == Q.Q4_1:
        blocks[:, :, 2:4] = np.array([-0.075], np.float16).view(np.uint8)
    return blocks.reshape(N, -1)


def check_every_case(seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    for qtype in TYPES:
        for N, K in ((1, 32), (33, 64), (300, 96), (1000, 576)):
            raw = random_rows(qtype, N, K, rng)
            for M in (1, 2, 5, 16):
                x = torch.randn(M, K, generator=gen) * float(rng.choice([1e-3, 1.0, 30.0]))
                x[:, int(rng.integers(0, K))] *= 50  # an outlier feature
                _check(x, raw, qtype)
            _check(torch.randn(2, 3, K, generator=gen), raw, qtype)  # leading dims
            _check(torch.randn(4, 2 * K, generator=gen)[:, ::2], raw, qtype)  # strided rows
        for N in (100, 300):  # within the cap of candidates, and over it
            raw = _near_ties(qtype, N, 128, rng)
            _, _, w = _weight(raw, qtype)
            x = torch.randn(8, 128, generator=gen)
            x[:4] = w[0].float() + 1e-3 * x[:4]  # rows pointing at the family
            _check(x, raw, qtype)
        # exact ties: duplicate columns, the first of them the answer (same panel; 40 and 75 in
        # others at NR 16 or 32), each the argmax by construction (x along it)
        raw = _even_scales(random_rows(qtype, 90, 64, rng), qtype)
        for a, b in ((3, 5), (10, 40), (41, 75)):
            raw[b] = raw[a]
        _, _, w = _weight(raw, qtype)
        x = torch.stack([w[3], w[5], w[10], w[41], -w[40]]).float()
        got = _check(x, raw, qtype)
        assert got[:4].tolist() == [3, 3, 10, 41]


def check_unscreenable_rows(seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    for qtype in TYPES:
        raw = random_rows(qtype, 70, 64, rng)
        x = torch.randn(7, 64, generator=torch.Generator().manual_seed(seed))
        x[1, 5] = float("nan")
        x[2, 9] = float("inf")
        x[3] = 0.0  # every logit 0: all tie, index 0
        x[4] = 3e38  # products beyond fp32: inf and NaN logits
        x[5, 0] = -float("inf")
        got = _check(x, raw, qtype)
        assert got[3].item() == 0
        assert _check(torch.zeros(1, 64), raw, qtype).item() == 0


def check_bound(seed: int = 0) -> None:
    """The screen's bound holds for every column (|a - exact| <= E), the exact argmax is always
    a candidate, typical rows leave few candidates, and ties beyond the cap take the whole
    product (count -1)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    for qtype in TYPES:
        counts = []
        for N, K in ((300, 96), (2000, 576)):
            raw = random_rows(qtype, N, K, rng)
            packed, sums, _ = _weight(raw, qtype)
            x = torch.randn(24, K, generator=gen) * torch.logspace(-3, 2, 24)[:, None]
            x[::3, int(rng.integers(0, K))] *= 50
            a, E, count = ops.debug_greedy_screen(x, packed, int(qtype), N, sums)
            exact = ops.cpu_linear_gguf(x, packed, int(qtype), N)
            assert ((a.double() - exact.double()).abs() <= E.double()).all()
            lo = (a - E).max(1, keepdim=True).values
            top = exact.argmax(1, keepdim=True)
            assert (a.gather(1, top) + E.gather(1, top) >= lo).all()  # the winner is kept
            assert ((a + E >= lo).sum(1) == count).all()
            counts += count.tolist()
        assert max(counts) <= 16 and np.median(counts) <= 2, counts
        # 600 equal columns tie in every row: more candidates than the cap
        raw = np.repeat(random_rows(qtype, 1, 128, rng), 600, axis=0)
        packed, sums, w = _weight(raw, qtype)
        x = torch.randn(3, 128, generator=gen)
        assert ops.debug_greedy_screen(x, packed, int(qtype), 600, sums)[2].tolist() == [-1] * 3
        assert _check(x, raw, qtype).tolist() == [0] * 3


def test_the_bound_holds_and_screens():
    check_bound()


def test_greedy_is_the_exact_argmax():
    check_every_case()


def test_rows_it_cannot_screen_take_the_whole_product():
    check_unscreenable_rows()


@pytest.mark.parametrize("threads", [1, 2])
def test_any_thread_count(threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_every_case(seed=threads + 10)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa(isa, in_isa_process):
    in_isa_process(
        isa,
        "from test_greedy_head import check_bound, check_every_case, check_unscreenable_rows\n"
        "check_every_case(3)\ncheck_unscreenable_rows(4)\ncheck_bound(5)\n",
    )


def test_abs_sums_bound_the_weights():
    rng = np.random.default_rng(5)
    for qtype in TYPES:
        raw = random_rows(qtype, 77, 96, rng)
        packed, sums, w = _weight(raw, qtype)
        assert sums.shape == (78,) and sums.dtype == torch.float32
        col = w.abs().sum(1)
        assert (sums[:-1].double() >= col).all()
        assert sums[-1].item() == sums[:-1].max().item()
        if qtype == Q.Q8_0:  # |d q| exactly: the sum rounded up, within fp32's ulp
            torch.testing.assert_close(sums[:-1].double(), col, rtol=2e-7, atol=0)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda p, s: ops.cpu_linear_gguf_greedy(torch.randn(2, 64), p, 12, 40, s),
         "screens Q4_1 .3. and Q8_0 .8."),
        (lambda p, s: ops.cpu_linear_gguf_greedy(torch.randn(2, 64), p, 8, 40, s[:-1]),
         "abs_sums must be float32 .out_features . 1."),
        (lambda p, s: ops.cpu_linear_gguf_greedy(torch.randn(2, 64).bfloat16(), p, 8, 40, s),
         "x must be a float32 CPU tensor"),
        (lambda p, s: ops.cpu_linear_gguf_greedy(torch.randn(2, 64), p, 8, 70, s),
         "packed has shape"),
        (lambda p, s: ops.cpu_linear_gguf_abs_sums(p, 14, 40, 64), "Q4_1 .3. and Q8_0 .8."),
    ],
)  # fmt: skip
def test_errors_say_what_is_wrong(call, match):
    raw = random_rows(Q.Q8_0, 40, 64, np.random.default_rng(0))
    packed, sums, _ = _weight(raw, Q.Q8_0)
    with pytest.raises(ValueError, match=match):
        call(packed, sums)


@pytest.mark.parametrize("head", [Q.Q8_0, Q.Q4_1, Q.Q6_K], ids=lambda q: q.name)
def test_decoding_uses_it_and_every_method_is_unchanged(head, tmp_path, monkeypatch):
    from jacobi_ext import generate
    from jacobi_ext.decoding import lean
    from jacobi_ext.models.quantized import build_on_codes

    cfg = tiny_config()
    model = build_on_codes(cfg, write_tiny_model(tmp_path / "tiny.gguf", cfg, head_type=head))
    calls = []
    real = lean._GreedyHead.__call__
    monkeypatch.setattr(lean._GreedyHead, "__call__", lambda s, x: calls.append(1) or real(s, x))
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(7))
    runs = {}
    for screen in ("1", "0"):
        monkeypatch.setenv("JACOBI_EXT_GREEDY_SCREEN", screen)
        for method in ("ar", "jacobi", "multiblock"):
            n = len(calls)
            runs[screen, method] = generate(
                model, ids, max_new_tokens=40, method=method, block_size=8
            ).tokens
            used = len(calls) > n
            assert used == (screen == "1" and head != Q.Q6_K), (screen, method, head)
    first = runs["0", "ar"]
    for key, tokens in runs.items():
        assert torch.equal(tokens, first), key


@pytest.mark.slow
def test_default_models_head_on_its_own_hidden_states(monkeypatch):
    """SmolLM2's Q8_0 head on the hidden states of a real decoding: the bound holds, a row keeps
    a few candidates (the screen pays), and the pick is the exact argmax."""
    from jacobi_ext import generate
    from jacobi_ext.decoding import lean
    from jacobi_ext.models import load_model

    model, tok = load_model()
    seen = []
    real = lean.LeanDecoder._head

    def keep(self, x, n, greedy=False):
        seen.append(x.reshape(-1, x.shape[-1]).clone())
        return real(self, x, n, greedy)

    monkeypatch.setattr(lean.LeanDecoder, "_head", keep)
    ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
    generate(model, ids, max_new_tokens=48, method="jacobi")
    x = torch.cat(seen)
    head = model.lm_head
    packed, qtype, N = head.args()[:3]
    sums = ops.cpu_linear_gguf_abs_sums(packed, qtype, N, head.in_features)
    a, E, count = ops.debug_greedy_screen(x, packed, qtype, N, sums)
    exact = ops.cpu_linear_gguf(x, packed, qtype, N)
    assert ((a.double() - exact.double()).abs() <= E.double()).all()
    assert (count >= 1).all() and count.double().median() <= 2, count
    got = ops.cpu_linear_gguf_greedy(x, packed, qtype, N, sums)
    assert torch.equal(got, ops.argmax(exact))
