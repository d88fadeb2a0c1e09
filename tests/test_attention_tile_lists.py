"""Per-CTA tile lists of the sm_90a attention (csrc/include/jacobi/tile_list.h), built on the host
by jacobi_ext::attention_tile_lists, against a dense mask computed here from the block table.

Every (query tile, key tile) pair is classified from the dense mask in the lists' own permuted
order: empty pairs must not be listed, full ones listed without a mask, partial ones listed with
a bit mask equal to the dense one. The CUDA consumer (sm_90a only) is checked against the CPU one.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from jacobi_ext import BlockTable, JacobiLayout

ops = torch.ops.jacobi_ext


def table_mask(starts, ptr, idx, S):
    """Dense mask of an arbitrary block table (block_table.h's visible_token), token by token;
    tokens past the last block see nothing and are seen by nobody."""
    starts, ptr, idx = starts.tolist(), ptr.tolist(), idx.tolist()
    blk = [-1] * S
    for b in range(len(starts) - 1):
        for t in range(starts[b], min(starts[b + 1], S)):
            blk[t] = b
    m = torch.zeros(S, S, dtype=torch.bool)
    for q in range(S):
        if blk[q] < 0:
            continue
        vis = set(idx[ptr[blk[q]] : ptr[blk[q] + 1]])
        for k in range(S):
            if blk[k] >= 0:
                m[q, k] = (k <= q) if blk[k] == blk[q] else (blk[k] in vis)
    return m


def unpack(words: torch.Tensor, tile_n: int) -> torch.Tensor:
    """[tile_m, tile_n / 32] int32 bit words -> [tile_m, tile_n] bool."""
    bits = torch.arange(32)
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w[:, :, None] >> bits) & 1).bool().reshape(words.shape[0], tile_n)


def check_lists(starts, ptr, idx, S, mask, tile_m, tile_n):
    """Returns (listed, partial) after checking every pair; mask: dense [S, S] in token order."""
    perm, fwd_ptr, fwd_tile, fwd_mask, bwd_ptr, bwd_tile, bwd_mask, masks = (
        ops.attention_tile_lists(starts, ptr, idx, S, tile_m, tile_n)
    )
    # The same permutation as the sm_80 kernels' plan (one stream order for every kernel).
    assert torch.equal(perm, ops.debug_tile_plan(starts, ptr, idx, S)[0])
    assert sorted(perm.tolist()) == list(range(S))
    mp = mask[perm.long()][:, perm.long()]
    nq, nk = math.ceil(S / tile_m), math.ceil(S / tile_n)
    # Pad to whole tiles: rows past S do not exist, columns past S are never visible.
    padded = torch.zeros(nq * tile_m, nk * tile_n, dtype=torch.bool)
    padded[:S, :S] = mp
    assert fwd_ptr.shape == (nq + 1,) and bwd_ptr.shape == (nk + 1,)
    assert masks.shape[1:] == (tile_m, tile_n // 32)
    listed = partial = 0
    seen_masks = set()
    bwd_want: dict[int, list[tuple[int, int]]] = {j: [] for j in range(nk)}
    for i in range(nq):
        rows = slice(i * tile_m, min((i + 1) * tile_m, S))
        entries = list(
            zip(
                fwd_tile[fwd_ptr[i] : fwd_ptr[i + 1]].tolist(),
                fwd_mask[fwd_ptr[i] : fwd_ptr[i + 1]].tolist(),
                strict=True,
            )
        )
        assert [j for j, _ in entries] == sorted({j for j, _ in entries}), "ascending, no repeats"
        by_tile = dict(entries)
        for j in range(nk):
            sub = padded[rows, j * tile_n : (j + 1) * tile_n]
            if not sub.any():
                assert j not in by_tile, f"fully masked pair ({i}, {j}) is listed"
                continue
            assert j in by_tile, f"pair ({i}, {j}) with visible keys is missing"
            m = by_tile[j]
            listed += 1
            bwd_want[j].append((i, m))
            if bool(sub.all()):
                assert m == -1, f"fully visible pair ({i}, {j}) has a mask"
                continue
            assert m >= 0, f"partial pair ({i}, {j}) is flagged fully visible"
            assert m not in seen_masks
            seen_masks.add(m)
            partial += 1
            got = unpack(masks[m], tile_n)
            want = padded[i * tile_m : (i + 1) * tile_m, j * tile_n : (j + 1) * tile_n]
            assert torch.equal(got, want), f"mask of pair ({i}, {j})"
    assert fwd_tile.numel() == listed and masks.shape[0] == partial == len(seen_masks)
    for j in range(nk):
        got = list(
            zip(
                bwd_tile[bwd_ptr[j] : bwd_ptr[j + 1]].tolist(),
                bwd_mask[bwd_ptr[j] : bwd_ptr[j + 1]].tolist(),
                strict=True,
            )
        )
        assert got == bwd_want[j], f"backward list of key tile {j}"
    # The consumer walks the lists back to the dense mask (permuted order).
    vis = ops.debug_expand_tile_lists(fwd_ptr, fwd_tile, fwd_mask, masks, S, tile_m, tile_n)
    assert torch.equal(vis.bool(), mp)
    return listed, partial


TILES = [(128, 128), (64, 64), (128, 64), (64, 128), (16, 32), (48, 96)]


@pytest.mark.parametrize("tile_m,tile_n", TILES)
@pytest.mark.parametrize(
    "P,n,T,variant,w",
    [
        (37, 16, 5, "noisy_context", None),
        (0, 32, 4, "clean_context", None),
        (100, 8, 9, "windowed", 3),
        (5, 3, 1, "noisy_context", None),
    ],
)
def test_jf_layouts(P, n, T, variant, w, tile_m, tile_n):
    layout = JacobiLayout(P, n, T, variant, w)
    t = layout.block_table()
    check_lists(*t.tensors(), layout.seq_len, layout.dense_mask(), tile_m, tile_n)


@pytest.mark.parametrize("seed", range(12))
def test_random_tables(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(0 if rng.random() < 0.1 else 1, 90) for _ in range(rng.randint(1, 10))]
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    S = starts[-1] + rng.choice([0, 0, 0, 7])  # sometimes tokens past the last block
    ptr, idx = [0], []
    for qb in range(len(sizes)):
        idx += [kb for kb in range(qb) if rng.random() < 0.5]
        ptr.append(len(idx))
    t = [torch.tensor(x, dtype=torch.int32) for x in (starts, ptr, idx)]
    if S == 0:
        return
    tile_m, tile_n = rng.choice(TILES)
    check_lists(*t, S, table_mask(*t, S), tile_m, tile_n)


@pytest.mark.parametrize("seed", range(6))
def test_random_jf_layouts(seed):
    rng = random.Random(100 + seed)
    variant = rng.choice(["noisy_context", "clean_context", "windowed"])
    w = rng.randint(1, 4) if variant == "windowed" else None
    layout = JacobiLayout(
        rng.choice([0, 1, rng.randint(2, 150)]), rng.randint(1, 40), rng.randint(1, 7), variant, w
    )
    tile_m, tile_n = rng.choice(TILES)
    check_lists(
        *layout.block_table().tensors(), layout.seq_len, layout.dense_mask(), tile_m, tile_n
    )


def test_noisy_context_streams_skip_almost_everything():
    """In stream order with tile-aligned streams, noisy_context lists only the causal triangles
    of its two streams (plus their shared prompt columns) and masks only diagonal tiles."""
    P, n, T, tile = 256, 64, 8, 128  # prompt and each stream a whole number of tiles
    layout = JacobiLayout(P, n, T)
    listed, partial = check_lists(
        *layout.block_table().tensors(), layout.seq_len, layout.dense_mask(), tile, tile
    )
    p, s = P // tile, T * n // tile  # tiles of the prompt and of each stream
    assert partial == p + 2 * s  # the diagonal tiles
    tri = lambda m: m * (m + 1) // 2  # noqa: E731
    assert listed == tri(p) + 2 * (s * p + tri(s))


def test_bad_arguments():
    t = JacobiLayout(3, 2, 2).block_table()
    with pytest.raises(ValueError, match=r"tile_n must be a multiple of 32"):
        ops.attention_tile_lists(*t.tensors(), 11, 64, 48)
    with pytest.raises(ValueError, match=r"tile_m must be a multiple of 16"):
        ops.attention_tile_lists(*t.tensors(), 11, 8, 64)
    bad = BlockTable(t.block_start, t.kv_ptr, torch.tensor([0, 0, 5, 1, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kv_idx of query block"):
        ops.attention_tile_lists(*bad.tensors(), 11, 64, 64)
    with pytest.raises(ValueError, match=r"end at most at seq_len"):
        ops.attention_tile_lists(*t.tensors(), 10, 64, 64)
    lists = ops.attention_tile_lists(*t.tensors(), 11, 64, 64)
    with pytest.raises(ValueError, match=r"fwd_ptr must have 2 entries"):
        ops.debug_expand_tile_lists(lists[1][:1], *lists[2:4], lists[7], 11, 64, 64)
    with pytest.raises(ValueError, match=r"fwd_tile entries must be key tiles"):
        ops.debug_expand_tile_lists(lists[1], lists[2] + 3, lists[3], lists[7], 11, 64, 64)


def _sm90_device() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90_device(), reason="the tile-list consumer is sm_90a code")
@pytest.mark.parametrize("tile_m,tile_n", [(128, 128), (64, 96)])
def test_cuda_consumer_matches_cpu(tile_m, tile_n):
    import jacobi_ext

    if "sm_90a" not in jacobi_ext.build_info()["cuda archs"]:
        pytest.skip("this build has no sm_90a objects")
    layout = JacobiLayout(77, 16, 6, "windowed", 2)
    S = layout.seq_len
    lists = ops.attention_tile_lists(*layout.block_table().tensors(), S, tile_m, tile_n)
    args = (lists[1], lists[2], lists[3], lists[7])
    want = ops.debug_expand_tile_lists(*args, S, tile_m, tile_n)
    got = ops.debug_expand_tile_lists(*(x.cuda() for x in args), S, tile_m, tile_n)
    assert torch.equal(got.cpu(), want)
