"""cpu_kv_commit, the CPU decoding step's commit (jacobi_ext/decoding/runtime.py): for every cache
[B, H, capacity, D] and each sequence b, slots [src[b], src[b] + count[b]) move to [dst[b], ...),
exactly as the indexed copy the runtime runs on other devices (gather, then scatter)."""

from __future__ import annotations

import pytest
import torch

import jacobi_ext  # noqa: F401  (registers torch.ops.jacobi_ext)


def _indexed_commit(caches, src, dst, count):
    """The runtime's device path (StaticRuntime.commit without the native op)."""
    B, width = src.shape[0], int(count.max()) if count.numel() else 0
    ar = torch.arange(max(width, 1))[None, :]
    valid = ar < count[:, None]
    s = torch.where(valid, src[:, None] + ar, ar)
    d = torch.where(valid, dst[:, None] + ar, ar)
    rows = torch.arange(B)[:, None].expand(-1, ar.shape[1])
    for buf in caches:
        t = buf.transpose(1, 2)
        t[rows, d] = t[rows, s]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_matches_the_indexed_copy(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    B, H, D = int(torch.randint(1, 4, (1,), generator=g)), 3, 8
    scratch = int(torch.randint(1, 9, (1,), generator=g))
    cap = scratch + 20
    count = torch.randint(0, scratch + 1, (B,), generator=g)
    src = torch.stack([torch.randint(0, scratch - int(c) + 1, (1,), generator=g)[0] for c in count])
    # scratch slots first, committed ones after: dst past the scratch, or (seed 0) onto src itself
    dst = src.clone() if seed == 0 else torch.randint(scratch, cap - scratch, (B,), generator=g)
    caches = [torch.randn(B, H, cap, D, generator=g).to(dtype) for _ in range(4)]
    want = [c.clone() for c in caches]
    _indexed_commit(want, src, dst, count)
    torch.ops.jacobi_ext.cpu_kv_commit(caches, src, dst, count)
    for got, ref in zip(caches, want, strict=True):
        assert torch.equal(got, ref)


def test_overlapping_ranges_move_as_a_gather_then_scatter():
    cache = torch.arange(10.0).view(1, 1, 10, 1).repeat(1, 2, 1, 3).contiguous()
    want = cache.clone()
    want[:, :, 2:6] = cache[:, :, 0:4].clone()
    one = torch.tensor([0]), torch.tensor([2]), torch.tensor([4])
    torch.ops.jacobi_ext.cpu_kv_commit([cache], *one)
    assert torch.equal(cache, want)


def test_bad_arguments_say_what_is_wrong():
    cache = torch.zeros(1, 2, 8, 4)
    op = torch.ops.jacobi_ext.cpu_kv_commit
    with pytest.raises(ValueError, match="outside the cache"):
        op([cache], torch.tensor([6]), torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(ValueError, match="src must have dtype Long"):
        op([cache], torch.tensor([0], dtype=torch.int32), torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        op([cache.transpose(2, 3)], torch.tensor([0]), torch.tensor([1]), torch.tensor([1]))
