"""The CPU decoding step's cache ops. kv_commit, the step's commit (runtime.py): for every
cache [B, H, capacity, D] and each sequence b, slots [src[b], src[b] + count[b]) move to [dst[b],
...), exactly as the indexed copy the runtime runs on other devices (gather, then scatter); and
cpu_rope_attention's kept transposed keys (kt_cache), bitwise the same as transposing the cache."""

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
    torch.ops.jacobi_ext.kv_commit(caches, src, dst, count, [])
    for got, ref in zip(caches, want, strict=True):
        assert torch.equal(got, ref)


def test_overlapping_ranges_move_as_a_gather_then_scatter():
    cache = torch.arange(10.0).view(1, 1, 10, 1).repeat(1, 2, 1, 3).contiguous()
    want = cache.clone()
    want[:, :, 2:6] = cache[:, :, 0:4].clone()
    one = torch.tensor([0]), torch.tensor([2]), torch.tensor([4])
    torch.ops.jacobi_ext.kv_commit([cache], *one, [])
    assert torch.equal(cache, want)


def test_bad_arguments_say_what_is_wrong():
    cache = torch.zeros(1, 2, 8, 4)
    op = torch.ops.jacobi_ext.kv_commit
    with pytest.raises(ValueError, match="outside the cache"):
        op([cache], torch.tensor([6]), torch.tensor([0]), torch.tensor([3]), [])
    with pytest.raises(ValueError, match="src must have dtype Long"):
        op([cache], torch.tensor([0], dtype=torch.int32), torch.tensor([0]), torch.tensor([1]), [])
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        op([cache.transpose(2, 3)], torch.tensor([0]), torch.tensor([1]), torch.tensor([1]), [])


def _blocks(keys: torch.Tensor) -> torch.Tensor:
    """keys [B, H, cap, D] (cap a multiple of 16) as transposed blocks [B, H, cap / 16, D, 16]."""
    B, H, cap, D = keys.shape
    return keys.float().view(B, H, cap // 16, 16, D).transpose(3, 4).contiguous()


@pytest.mark.parametrize(
    "src,dst,count",
    [([1, 0], [9, 5], [4, 2]), ([14, 3], [30, 13], [5, 7]), ([20, 2], [17, 5], [6, 9])],
)
def test_transposed_copies_move_with_their_slots(src, dst, count):
    """Across block boundaries and with overlapping ranges (moved down and up), as a gather then
    scatter of the cache itself."""
    g = torch.Generator().manual_seed(3)
    B, H, cap, D = 2, 3, 48, 8
    keys = torch.randn(B, H, cap, D, generator=g)
    kt = _blocks(keys)
    src, dst, count = torch.tensor(src), torch.tensor(dst), torch.tensor(count)
    torch.ops.jacobi_ext.kv_commit([keys], src, dst, count, [kt])
    assert torch.equal(kt, _blocks(keys))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Q", [1, 5])
def test_rope_attention_from_kept_transposed_keys_is_bitwise(dtype, Q):
    """cpu_rope_attention with kt_cache (the lean forward's default) writes the step's keys there
    too and gives bitwise the output of transposing the cache itself, step after step."""
    from jacobi_ext.decoding.executors import keys_transposed

    g = torch.Generator().manual_seed(Q)
    B, heads, kv_heads, D, cap = 2, 6, 2, 16, 40
    caches = [torch.zeros(B, kv_heads, cap, D, dtype=dtype) for _ in range(4)]
    kt = keys_transposed(caches[0])
    assert kt.shape == (B, kv_heads, 3, D, 16)
    op = torch.ops.jacobi_ext.cpu_rope_attention
    for step in range(4):
        qkv = torch.randn(B, Q, (heads + 2 * kv_heads) * D, generator=g).to(dtype)
        cos, sin = (torch.randn(B, Q, D, generator=g).to(dtype) for _ in range(2))
        slots = torch.arange(Q) + step * Q
        attend = int(slots[-1]) + 1 + step  # a few written-but-masked or unwritten slots too
        mask = torch.rand(B, 1, Q, attend, generator=g) < 0.8
        mask[..., 0] = True
        want = op(qkv, heads, kv_heads, cos, sin, caches[0], caches[1], slots, attend, mask, 0.3)
        got = op(qkv, heads, kv_heads, cos, sin, caches[2], caches[3], slots, attend, mask, 0.3, kt)
        assert torch.equal(got, want)
        assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
        full = torch.cat([caches[2], caches[2].new_zeros(B, kv_heads, 48 - cap, D)], dim=2)
        written = torch.zeros(48, dtype=torch.bool)
        written[: int(slots[-1]) + 1] = True  # slots written so far; the rest still zeros
        want_kt = _blocks(full * written[:, None])
        assert torch.equal(kt, want_kt)


def test_kt_cache_shape_is_checked():
    op = torch.ops.jacobi_ext.cpu_rope_attention
    k, v = torch.zeros(1, 1, 10, 4), torch.zeros(1, 1, 10, 4)
    qkv, cs = torch.zeros(1, 1, 12), torch.zeros(1, 1, 4)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="kt_cache must be"):
        op(qkv, 1, 1, cs, cs, k, v, torch.tensor([0]), 1, mask, 1.0, torch.zeros(1, 1, 4, 16))
    with pytest.raises(ValueError, match="kt_cache must be"):  # too few blocks for 10 slots
        op(qkv, 1, 1, cs, cs, k, v, torch.tensor([0]), 1, mask, 1.0, torch.zeros(1, 1, 0, 4, 16))
    ok = torch.zeros(1, 1, 1, 4, 16)
    op(qkv, 1, 1, cs, cs, k, v, torch.tensor([0]), 1, mask, 1.0, ok)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on x [B, Q, H, D] (cos, sin [B, Q, D]), each product
    and the sum rounded to x's dtype, as the op rotates."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None] + rot * sin[:, :, None]


@pytest.mark.parametrize("Q", [1, 5, 16])
def test_rope_attention_on_a_half_cache(Q):
    """float16 caches (and kept keys) with float32 qkv: the op writes the rotated k and v rounded
    to fp16 (bitwise the fp32 op's cache, rounded) and returns bitwise the attention of the rotated
    queries over the half cache (cpu_decode_attention: the fp32 attention over the rounded keys and
    values), step after step; the commit moves the half kept keys with their slots."""
    from jacobi_ext.decoding.executors import keys_transposed

    g = torch.Generator().manual_seed(Q)
    B, heads, kv_heads, D, cap, scale = 2, 6, 2, 16, 64, 0.3
    k32, v32 = torch.zeros(B, kv_heads, cap, D), torch.zeros(B, kv_heads, cap, D)
    k16, v16 = k32.half(), v32.half()
    kt = keys_transposed(k16)
    assert kt.dtype == torch.float16
    op = torch.ops.jacobi_ext.cpu_rope_attention
    for step in range(3):
        qkv = torch.randn(B, Q, (heads + 2 * kv_heads) * D, generator=g)
        cos, sin = torch.randn(B, Q, D, generator=g), torch.randn(B, Q, D, generator=g)
        slots = torch.arange(Q) + step * Q
        attend = int(slots[-1]) + 1
        mask = torch.rand(B, 1, Q, attend, generator=g) < 0.8
        mask[..., 0] = True
        op(qkv, heads, kv_heads, cos, sin, k32, v32, slots, attend, mask, scale)
        got = op(qkv, heads, kv_heads, cos, sin, k16, v16, slots, attend, mask, scale, kt)
        assert torch.equal(k16[:, :, :attend], k32[:, :, :attend].half())
        assert torch.equal(v16[:, :, :attend], v32[:, :, :attend].half())
        assert torch.equal(kt.float(), _blocks(k16))
        q = _rotated(qkv[..., : heads * D].view(B, Q, heads, D), cos, sin).transpose(1, 2)
        want = torch.ops.jacobi_ext.cpu_decode_attention(
            q, k16[:, :, :attend], v16[:, :, :attend], mask, scale
        )
        assert got.dtype == torch.float32 and torch.equal(got, want)
    src, dst, count = torch.tensor([0, 2]), torch.tensor([20, 33]), torch.tensor([5, 9])
    torch.ops.jacobi_ext.kv_commit([k16, v16], src, dst, count, [kt])
    assert torch.equal(kt.float(), _blocks(k16))


def test_a_half_cache_goes_with_fp32_qkv_and_half_kept_keys():
    op = torch.ops.jacobi_ext.cpu_rope_attention
    k, v = torch.zeros(1, 1, 16, 4, dtype=torch.half), torch.zeros(1, 1, 16, 4, dtype=torch.half)
    qkv, cs = torch.zeros(1, 1, 12), torch.zeros(1, 1, 4)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    args = (torch.tensor([0]), 1, mask, 1.0)
    with pytest.raises(ValueError, match="kt_cache must be a contiguous Half"):
        op(qkv, 1, 1, cs, cs, k, v, *args, torch.zeros(1, 1, 1, 4, 16))
    with pytest.raises(ValueError, match="with float32 qkv"):
        op(qkv.bfloat16(), 1, 1, cs.bfloat16(), cs.bfloat16(), k, v, *args)
    op(qkv, 1, 1, cs, cs, k, v, *args, torch.zeros(1, 1, 1, 4, 16, dtype=torch.half))


def test_the_runtimes_torch_commit_moves_what_the_op_moves():
    """StaticRuntime.commit has one move: the kv_commit op, or its torch statement
    (_commit_reference) where a device has no kernel; both move the same slots, and hi advances
    alike (in place too: the K/V already there, only hi moves)."""
    from jacobi_ext.decoding.runtime import StaticRuntime
    from jacobi_ext.models import tiny_llama

    model = tiny_llama(vocab_size=50, hidden_size=64, num_heads=4, num_kv_heads=2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (3, 6), generator=g)
    rts = [StaticRuntime(model, 3, 24, 8) for _ in range(2)]
    rts[1]._kv_commit = None  # the torch statement
    for rt in rts:
        rt.prefill(ids, torch.tensor([0, 2, 5]), None)
    with torch.inference_mode():  # (the runtime's buffers are inference tensors)
        for a, b in zip(rts[0].cache.layers, rts[1].cache.layers, strict=True):
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                x.copy_(torch.randn(x.shape, generator=g))
                y.copy_(x)
        src, count = torch.tensor([0, 3, 1]), torch.tensor([2, 5, 0])
        for rt in rts:
            rt.commit(src, count)
            rt.commit(None, torch.tensor([1, 0, 2]), in_place=True)
    assert torch.equal(rts[0].hi, rts[1].hi) and rts[0].hi.tolist() == [17, 19, 16]
    for a, b in zip(rts[0].cache.layers, rts[1].cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
