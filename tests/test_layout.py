"""JacobiLayout / BlockTable: position ids, masks and tables against hand-worked examples and an
independent token-level restatement of docs/method.md §1 (written here from that text, not from
the C++)."""

from __future__ import annotations

import itertools

import pytest
import torch

from jacobi_ext import BlockTable, JacobiLayout


# ---- docs/method.md §1, restated token by token ---------------------------------------------
def spec_token(P: int, n: int, i: int) -> tuple[str, int]:
    """(kind, pair) of token i (docs/method.md §1): pair -1 for the prompt."""
    if i < P:
        return "prompt", -1
    b = (i - P) // n
    return ("noisy" if b % 2 == 0 else "clean"), b // 2


def spec_mask(P: int, n: int, T: int, variant: str, w: int | None) -> torch.Tensor:
    L = P + 2 * T * n
    m = torch.zeros(L, L, dtype=torch.bool)
    for q in range(L):
        kq, jq = spec_token(P, n, q)
        for k in range(q + 1):  # every variant is causal in token order
            kk, jk = spec_token(P, n, k)
            if kq != "noisy" or variant == "noisy_context":
                ok = kk == "prompt" or kk == kq
            else:
                own = kk == "noisy" and jk == jq  # own block, causally (k <= q above)
                if variant == "clean_context":
                    ok = kk == "prompt" or (kk == "clean" and jk < jq) or own
                else:
                    i0 = (jq // w) * w
                    ok = (
                        kk == "prompt"
                        or (kk == "clean" and jk < i0)
                        or (kk == "noisy" and i0 <= jk < jq)
                        or own
                    )
            m[q, k] = ok
    return m


CASES = [
    (P, n, T, var, w)
    for P, n, T in [(0, 1, 1), (0, 3, 4), (1, 2, 3), (5, 3, 0), (7, 4, 5), (4, 1, 6), (3, 5, 2)]
    for var, w in [
        ("noisy_context", None),
        ("clean_context", None),
        ("windowed", 1),
        ("windowed", 2),
        ("windowed", 3),
        ("windowed", 10),
    ]
]


@pytest.mark.parametrize("P,n,T,variant,w", CASES)
def test_dense_mask_matches_spec(P, n, T, variant, w):
    layout = JacobiLayout(P, n, T, variant, w)
    assert layout.seq_len == P + 2 * T * n
    mask = layout.dense_mask()
    assert mask.dtype == torch.bool and mask.shape == (layout.seq_len, layout.seq_len)
    assert torch.equal(mask, spec_mask(P, n, T, variant, w))


def test_spec_restatement_is_not_vacuous():
    # The variants really differ on this example, so the test above can tell them apart.
    noisy, clean, windowed = (
        spec_mask(2, 2, 4, v, w)
        for v, w in [("noisy_context", None), ("clean_context", None), ("windowed", 2)]
    )
    assert not torch.equal(noisy, clean)
    assert not torch.equal(clean, windowed)
    assert not torch.equal(noisy, windowed)


def test_position_ids_hand_worked():
    layout = JacobiLayout(prompt_len=3, block_size=2, num_blocks=2)
    # prompt 0 1 2 | noisy_0 3 4 | clean_0 3 4 | noisy_1 5 6 | clean_1 5 6
    assert layout.position_ids().tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 5, 6]
    assert JacobiLayout(0, 3, 1).position_ids().tolist() == [0, 1, 2, 0, 1, 2]
    assert JacobiLayout(4, 3, 0).position_ids().tolist() == [0, 1, 2, 3]
    assert layout.position_ids().dtype == torch.long


def _parse(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in r] for r in rows])


def test_dense_mask_hand_worked():
    # P=1, n=2, T=2. Row = query, column = key, both in packed order: p n0 n0 c0 c0 n1 n1 c1 c1.
    noisy_context = [
        "1........",  # p
        "11.......",  # n0: prompt + own block, causally
        "111......",
        "1..1.....",  # c0: prompt + own block
        "1..11....",
        "111..1...",  # n1: prompt, noisy_0, own block
        "111..11..",
        "1..11..1.",  # c1: prompt, clean_0, own block
        "1..11..11",
    ]
    clean_context = [
        "1........",
        "11.......",
        "111......",
        "1..1.....",
        "1..11....",
        "1..111...",  # n1: prompt, clean_0, own block
        "1..1111..",
        "1..11..1.",
        "1..11..11",
    ]
    assert torch.equal(JacobiLayout(1, 2, 2, "noisy_context").dense_mask(), _parse(noisy_context))
    assert torch.equal(JacobiLayout(1, 2, 2, "clean_context").dense_mask(), _parse(clean_context))
    # windowed with w=1: i0 = j, i.e. exactly clean_context; with w >= T: noisy_context for noisy
    # queries (all earlier noisy blocks in the window, no clean ones).
    assert torch.equal(JacobiLayout(1, 2, 2, "windowed", 1).dense_mask(), _parse(clean_context))
    assert torch.equal(JacobiLayout(1, 2, 2, "windowed", 2).dense_mask(), _parse(noisy_context))


def test_block_table_format():
    t = JacobiLayout(5, 3, 4, "windowed", 2).block_table()
    assert isinstance(t, BlockTable)
    assert all(x.dtype == torch.int32 and x.dim() == 1 for x in t.tensors())
    assert t.num_blocks == 9 and t.seq_len == 5 + 2 * 4 * 3
    assert t.block_start.tolist() == [0, 5, 8, 11, 14, 17, 20, 23, 26, 29]
    kp, ki = t.kv_ptr.tolist(), t.kv_idx.tolist()
    for qb in range(t.num_blocks):
        row = ki[kp[qb] : kp[qb + 1]]
        assert row == sorted(set(row)) and all(0 <= kb < qb for kb in row)
    # no prompt block when P = 0
    assert JacobiLayout(0, 2, 2).block_table().block_start.tolist() == [0, 2, 4, 6, 8]


@pytest.mark.parametrize(
    "variant,w", [("noisy_context", None), ("clean_context", None), ("windowed", 2)]
)
def test_stream_order_table_is_the_same_mask(variant, w):
    layout = JacobiLayout(6, 3, 5, variant, w)
    table, perm = layout.block_table().reorder(layout.stream_order())
    mask = layout.dense_mask()
    assert torch.equal(table.dense_mask(), mask[perm][:, perm])
    # In stream order, clean queries form one causal stream over prompt + clean blocks.
    P, n, T = 6, 3, 5
    c = slice(0, P + T * n)
    assert torch.equal(table.dense_mask()[c, c], torch.ones(P + T * n, P + T * n).tril().bool())


def test_reorder_rejects_bad_orders():
    t = JacobiLayout(2, 2, 2).block_table()
    with pytest.raises(ValueError, match="permutation"):
        t.reorder([0, 1, 2])
    with pytest.raises(ValueError, match="before"):
        t.reorder([1, 0, 2, 3, 4])  # noisy_0 before the prompt it sees


@pytest.mark.parametrize(
    "variant,w", [("noisy_context", None), ("clean_context", None), ("windowed", 3)]
)
def test_flex_mask_mod_matches_dense_mask(variant, w):
    layout = JacobiLayout(5, 4, 6, variant, w)
    mm = layout.flex_mask_mod()
    idx = torch.arange(layout.seq_len)
    got = mm(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :])
    assert torch.equal(got, layout.dense_mask())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompt_len=-1, block_size=2, num_blocks=1), "prompt_len"),
        (dict(prompt_len=1, block_size=0, num_blocks=1), "block_size"),
        (dict(prompt_len=1, block_size=2, num_blocks=-2), "num_blocks"),
        (dict(prompt_len=1, block_size=2, num_blocks=1, variant="causal"), "variant"),
        (dict(prompt_len=1, block_size=2, num_blocks=1, variant="windowed"), "window"),
        (dict(prompt_len=1, block_size=2, num_blocks=1, variant="windowed", window=0), "window"),
        (dict(prompt_len=1, block_size=2, num_blocks=1, window=2), "window"),
    ],
)
def test_layout_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        JacobiLayout(**kwargs)


def test_jf_block_table_op_validates():
    ops = torch.ops.jacobi_ext
    with pytest.raises(ValueError, match="variant"):
        ops.jf_block_table(1, 2, 3, 7, 0)
    with pytest.raises(ValueError, match="window"):
        ops.jf_block_table(1, 2, 3, 2, 0)


def test_layout_is_hashable_and_compares_by_value():
    a, b = JacobiLayout(3, 2, 2), JacobiLayout(3, 2, 2)
    a.block_table()  # fills a's cache; must not affect equality
    assert a == b and hash(a) == hash(b)
    assert len({a, b, JacobiLayout(3, 2, 3)}) == 2


def test_all_small_layouts_are_consistent():
    # Exhaustive over tiny shapes: the table agrees with the restatement (docs/method.md §1).
    for P, n, T in itertools.product(range(3), range(1, 3), range(3)):
        for variant, w in [("noisy_context", None), ("clean_context", None), ("windowed", 1)]:
            got = JacobiLayout(P, n, T, variant, w).dense_mask()
            assert torch.equal(got, spec_mask(P, n, T, variant, w)), (P, n, T, variant, w)


def test_block_table_is_one_object_per_device():
    """The kernels cache the sm_90a tile lists on the table object (kernels/attention.py): the
    layout hands out the same table for a device every time, not a fresh copy per call (which
    built the tile lists again on the host at every attention call)."""
    layout = JacobiLayout(16, 8, 3, "clean_context")
    for device in ("cpu", "meta"):
        t = layout.block_table(device)
        assert layout.block_table(device) is t and t.device.type == device
        assert t.to(device) is t
    assert layout.block_table() is layout.block_table("cpu")
    # Equal layouts share it (training packs a new layout object per sequence).
    assert JacobiLayout(16, 8, 3, "clean_context").block_table("meta") is layout.block_table("meta")
    assert JacobiLayout(16, 8, 3).block_table() is not layout.block_table()
    meta = layout.block_table("meta")
    assert meta.seq_len == layout.seq_len and meta.block_start.shape == (1 + 1 + 2 * 3,)
