"""GGUF weights read as they are stored: torch.ops.jacobi_ext.cpu_linear_gguf
(csrc/cpu/linear_gguf_cpu.h) and the models built on it (jacobi_ext.models.quantized).

What makes the GGUF path lossless, checked here on tiny GGUF files the tests write with the
`gguf` package (tests/gguf_fixtures.py), for every type the kernels read:
- every weight the kernel dequantizes is bitwise the `gguf` package's value;
- every output is bitwise the fp32 kernel's (cpu_linear) on the dequantized weight, for any M,
  N off the panel width, several blocks along K, with a bias, on every ISA variant;
- a model built on the codes returns bitwise the logits of the same file loaded as transformers
  loads it (dequantized, q/k rows reordered) and run through the fp32 kernel, and its decoding
  returns the same tokens for every method; an adapter stays unmerged and every method still
  equals `ar`;
- types the kernels do not read run dequantized, with one warning naming them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, quants

from jacobi_ext.kernels._native import ops
from jacobi_ext.kernels.ops import cpu_linear_gguf_packed_shape

sys.path.insert(0, str(Path(__file__).parent))
from conftest import ISAS  # noqa: E402
from gguf_fixtures import (  # noqa: E402
    KERNEL_TYPES,
    dequantized_model,
    random_rows,
    tiny_config,
    write_tensors,
    write_tiny_model,
)

MS = (1, 2, 4, 7, 13, 16, 33, 64)  # 1-4: the 8-bit path straight from the panel; 7+: buffered
# ... and on 8-bit activations 70 rows too: the AMX tile's calls (65 rows or more), four whole
# tiles of 16 rows and a last one of 6
INT8_MS = (*MS, 70)
# off every multiple of the panel width (16 / 32); 150 and 190 (5 and 6 panels of 32): one row in
# threes of panels on two threads, the last unit two panels or a partial one
NS = (1, 5, 33, 100, 150, 190)
BLOCKS = (1, 2, 3)  # blocks along K


def _file_tensors(tmp_path: Path, qtype: Q, seed: int = 0) -> list:
    """(reader tensor, N, K) for every (N, blocks along K) of one type, read back from a file."""
    rng = np.random.default_rng(seed)
    bk = {Q.Q4_K: 256, Q.Q5_K: 256, Q.Q6_K: 256}.get(qtype, 32)
    tensors, shapes = {}, {}
    for n in NS:
        for b in BLOCKS:
            name = f"w_{n}_{b}"
            shapes[name] = (n, b * bk)
            tensors[name] = (random_rows(qtype, n, b * bk, rng), qtype, (n, b * bk))
    reader = GGUFReader(str(write_tensors(tmp_path / f"{qtype.name}.gguf", tensors)))
    return [(t, *shapes[t.name]) for t in reader.tensors]


def _dequantized(t, N, K) -> torch.Tensor:
    return torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type), np.float32)).reshape(
        N, K
    )


def _raw(t) -> torch.Tensor:
    return torch.from_numpy(np.array(t.data, dtype=np.uint8))


def check_type(qtype: Q, tmp_path: Path) -> None:
    """The kernel against gguf's dequantization and the fp32 kernel, every shape of one type."""
    g = torch.Generator().manual_seed(int(qtype))
    for t, N, K in _file_tensors(tmp_path, qtype):
        assert int(t.tensor_type) == int(qtype)
        w = _dequantized(t, N, K)
        packed = ops.cpu_linear_gguf_pack([_raw(t)], int(qtype))
        assert tuple(packed.shape) == cpu_linear_gguf_packed_shape(int(qtype), N, K)
        w_packed = ops.cpu_linear_pack(w)
        # The weights themselves: one-hot rows of x pick them out exactly.
        eye = torch.eye(K)[: min(K, 64)]
        assert torch.equal(ops.cpu_linear_gguf(eye, packed, int(qtype), N), w[:, : len(eye)].T)
        for M in MS:
            x = torch.randn(M, K, generator=g)
            bias = torch.randn(N, generator=g) if M % 2 else None
            y = ops.cpu_linear_gguf(x, packed, int(qtype), N, bias)
            assert torch.equal(y, ops.cpu_linear(x, w_packed, N, bias)), (qtype.name, N, K, M)
            if M > 1:  # a row's bits do not depend on the other rows of the call
                one = ops.cpu_linear_gguf(x[M // 2 : M // 2 + 1], packed, int(qtype), N, bias)
                assert torch.equal(y[M // 2], one[0])


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
def test_bitwise_fp32_kernel_on_gguf_values(qtype, tmp_path):
    check_type(qtype, tmp_path)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_row_is_the_same_bits_at_any_thread_count(threads, tmp_path):
    """A one-row call shares its panels out in pairs or threes, whichever evens the threads'
    shares (18 panels on two threads: threes): every output is the fp32 kernel's bits on the
    dequantized weights at any thread count, with a LoRA too."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = np.random.default_rng(threads)
        g = torch.Generator().manual_seed(threads)
        for N in (150, 190, 576, 960):
            t = _file_tensor(tmp_path, Q.Q4_1, N, 64, rng)
            w = _dequantized(t, N, 64)
            packed = ops.cpu_linear_gguf_pack([_raw(t)], int(Q.Q4_1))
            x = torch.randn(1, 64, generator=g)
            want = ops.cpu_linear(x, ops.cpu_linear_pack(w), N, None)
            assert torch.equal(ops.cpu_linear_gguf(x, packed, int(Q.Q4_1), N), want), N
    finally:
        torch.set_num_threads(before)


def _file_tensor(tmp_path: Path, qtype: Q, N: int, K: int, rng) -> object:
    """One [N, K] tensor of random codes, read back from a file of its own."""
    name = f"w_{N}_{K}"
    path = write_tensors(
        tmp_path / f"{name}.gguf", {name: (random_rows(qtype, N, K, rng), qtype, (N, K))}
    )
    return GGUFReader(str(path)).tensors[0]


def check_this_process(expected_isa: str, tmp: str) -> None:
    import jacobi_ext

    assert jacobi_ext.CPU_ISA == expected_isa, (jacobi_ext.CPU_ISA, expected_isa)
    for qtype in KERNEL_TYPES:
        check_type(qtype, Path(tmp))
    check_lora(Q.Q4_1, False)  # the LoRA's one- and two-vector tiles of this ISA
    check_lora(Q.Q4_1, True)


@pytest.mark.parametrize("isa", ISAS)
def test_every_isa(isa, in_isa_process, tmp_path):
    """Each ISA variant in a process of its own (capped to what the CPU has)."""
    in_isa_process(
        isa,
        "from test_gguf_linear import check_this_process\n"
        f"check_this_process(jacobi_ext.CPU_ISA, {str(tmp_path)!r})\n",
    )


def _q4_1_fields(raw: np.ndarray, N: int, K: int):
    """A Q4_1 weight's codes [N, K] (int64) and per-block d, m [N, K / 32] (float32)."""
    b = raw.reshape(N, K // 32, 20)
    d = torch.from_numpy(b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    m = torch.from_numpy(b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    c = b[..., 4:].astype(np.int64)
    codes = np.concatenate([c & 0xF, c >> 4], axis=-1).reshape(N, K)
    return torch.from_numpy(codes), d, m


def _q8_0_fields(raw: np.ndarray, N: int, K: int):
    """A Q8_0 weight's codes [N, K] (int64) and per-block d [N, K / 32] (float32); no offset."""
    b = raw.reshape(N, K // 32, 34)
    d = torch.from_numpy(b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    codes = b[..., 2:].copy().view(np.int8).astype(np.int64).reshape(N, K)
    return torch.from_numpy(codes), d, None


INT8_FIELDS = {Q.Q4_1: _q4_1_fields, Q.Q8_0: _q8_0_fields}


def int8_reference(x: torch.Tensor, codes, d, m, bias=None) -> torch.Tensor:
    """int8_activations' formula in float64: x quantized per row and group of 32 exactly as the
    kernel does (float32 products, round half to even), the integer sums exact, the scaled sums
    over groups in float64 (the kernel rounds each fused multiply-add to float32)."""
    M, K = x.shape
    xg = x.view(M, K // 32, 32)
    amax = xg.abs().amax(-1)
    inv = 127 / amax
    inv = torch.where((amax > 0) & inv.isfinite(), inv, torch.zeros_like(amax))  # tiny: q = 0
    q = torch.round(xg * inv[..., None]).clamp(-127, 127)
    dx = amax / 127
    msx = dx * q.sum(-1)
    isum = torch.einsum("ngk,mgk->mng", codes.view(-1, K // 32, 32).double(), q.double())
    y = (d[None] * dx[:, None]).double() * isum
    if m is not None:  # Q4_1's offset
        y = y + m[None].double() * msx[:, None].double()
    y = y.sum(-1)
    return y if bias is None else y + bias.double()


def check_int8(tmp_path: Path) -> dict:
    """The 8-bit-activation paths (Q4_1, Q8_0): their formula (float64 reference), a row's bits
    alone and among others; returns the outputs, for comparing ISAs."""
    g = torch.Generator().manual_seed(7)
    outs = {}
    for qtype, fields in INT8_FIELDS.items():
        outs.update(_check_int8_type(tmp_path / qtype.name, qtype, fields, g))
    return outs


def _check_int8_type(tmp_path: Path, qtype, fields, g) -> dict:
    outs = {}
    for t, N, K in _file_tensors(tmp_path, qtype):
        raw = np.array(t.data, dtype=np.uint8)
        codes, d, m = fields(raw, N, K)
        packed = ops.cpu_linear_gguf_pack([_raw(t)], int(qtype))
        w = _dequantized(t, N, K)
        for M in INT8_MS:
            x = torch.randn(M, K, generator=g)
            x[0, :7] = 0.0  # a group with zeros (and, at K = 32, most of one)
            if M > 1 and K >= 64:
                x[1, 32:64] *= 1e-38  # 127 / amax overflows: the group quantizes to 0
            bias = torch.randn(N, generator=g) if M % 2 else None
            y = ops.cpu_linear_gguf(x, packed, int(qtype), N, bias, int8_activations=True)
            ref = int8_reference(x, codes, d, m, bias)
            # fp32 rounding of the per-group sums: relative to the size of the terms
            scale = (x.abs().double() @ w.abs().double().T).max().item() + 1e-30
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6 * max(scale, 1.0))
            # ... and near the exact product (8-bit activations: ~1 % of the terms' size)
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            assert (y.double() - exact).abs().max().item() <= 0.02 * scale
            if M > 1:
                one = ops.cpu_linear_gguf(x[M // 2 : M // 2 + 1], packed, int(qtype), N, bias,
                                          int8_activations=True)  # fmt: skip
                assert torch.equal(y[M // 2], one[0])
            outs[f"{qtype.name} {N}x{K}/{M}"] = y
    return outs


def test_int8_activations(tmp_path):
    check_int8(tmp_path)
    x = torch.randn(2, 64)
    x[1, 40] = float("nan")  # a non-finite value: its row's outputs are NaN, the other row's not
    t, N, K = next((t, N, K) for t, N, K in _file_tensors(tmp_path / "nan", Q.Q4_1) if K == 64)
    packed = ops.cpu_linear_gguf_pack([_raw(t)], int(Q.Q4_1))
    y = ops.cpu_linear_gguf(x, packed, 3, N, int8_activations=True)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()
    # Q8_0 at the edge of the 16-bit pair sums: codes -128 and 127 against q = -127 and 127
    N, K = 17, 64
    raw = np.zeros((N, K // 32, 34), dtype=np.uint8)
    raw[..., 0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    raw[: N // 2, :, 2:] = 0x80  # -128
    raw[N // 2 :, :, 2:] = 0x7F  # 127
    raw = raw.reshape(N, -1)
    packed = ops.cpu_linear_gguf_pack([torch.from_numpy(raw)], int(Q.Q8_0))
    x = torch.stack([torch.full((K,), -3.0), torch.full((K,), 3.0), torch.randn(K)])
    y = ops.cpu_linear_gguf(x, packed, int(Q.Q8_0), N, int8_activations=True)
    codes, d, _ = _q8_0_fields(raw, N, K)
    torch.testing.assert_close(y.double(), int8_reference(x, codes, d, None), rtol=1e-6, atol=0)
    assert y[0, 0].item() == 0.5 * (3.0 / 127) * 128 * 127 * K  # every product exact
    q4_0 = ops.cpu_linear_gguf_pack([torch.zeros(4, 18, dtype=torch.uint8)], int(Q.Q4_0))
    with pytest.raises(ValueError, match="int8_activations is implemented for Q4_1 .* and Q8_0"):
        ops.cpu_linear_gguf(torch.randn(1, 32), q4_0, int(Q.Q4_0), 4, int8_activations=True)


def int8_this_process(expected_isa: str, tile: str, tmp: str, out: str) -> None:
    import jacobi_ext
    from jacobi_ext.kernels._native import CPU_INT8_TILE

    assert (jacobi_ext.CPU_ISA, CPU_INT8_TILE) == (expected_isa, tile)
    torch.save(check_int8(Path(tmp)), out)


def test_int8_activations_same_bits_on_every_isa(best_isa, tmp_path):
    """The integer sums are exact and the float steps the same fused multiply-adds in the same
    order on every ISA: the scalar loop and the vector tiles (AVX2's maddubs; AVX512-VNNI's
    vpdpbusd where the CPU has it, its codes arranged by vpermt2b where it has AVX512-VBMI too,
    AMX's tile products for 65 rows or more where it has AMX-INT8, and the AVX2 tile in the
    AVX-512 build without VNNI) give the same bits."""
    tiles = {"baseline": "scalar", "avx2": "avx2", "avx512": "avx2"}
    runs = [(isa, tiles[isa], {}) for isa in ISAS[: ISAS.index(best_isa) + 1]]
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    if best_isa == "avx512" and "avx512_vnni" in flags:
        # the AVX-512 build runs the VNNI tile (with VBMI's arrangement where the CPU has it);
        # turned off (env), the plain VNNI tile and the AVX2 one
        runs[-1] = ("avx512", "avx512-vnni", {"JACOBI_EXT_CPU_VBMI": "0"})
        runs.append(("avx512", "avx2", {"JACOBI_EXT_CPU_VNNI": "0"}))
        if "avx512vbmi" in flags:
            runs.append(("avx512", "avx512-vnni-vbmi", {"JACOBI_EXT_CPU_AMX": "0"}))
            if {"amx_tile", "amx_int8"} <= flags:
                runs.append(("avx512", "amx-int8", {}))
    got = {}
    for isa, tile, extra in runs:
        name = f"{isa}-{tile}"
        out = tmp_path / f"{name}.pt"
        code = (
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "from test_gguf_linear import int8_this_process\n"
            f"int8_this_process({isa!r}, {tile!r}, {str(tmp_path / name)!r}, {str(out)!r})\n"
        )
        tiles_env = ("JACOBI_EXT_CPU_V", "JACOBI_EXT_CPU_AMX")
        env = {k: v for k, v in os.environ.items() if not k.startswith(tiles_env)}
        env.update(JACOBI_EXT_CPU_ISA=isa, **extra)
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, cwd=tmp_path)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        got[name] = torch.load(out)
    base = got["baseline-scalar"]
    for name, outs in got.items():
        assert outs.keys() == base.keys()
        for k in base:
            assert torch.equal(outs[k], base[k]), (name, k)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_int8_prefill_rows_are_the_rows_alone_at_any_thread_count(qtype):
    """A prefill's hundreds of rows on 8-bit activations: their quantizing is split among the
    threads (a step's few rows stay on the calling thread); each row is the same bits as that row
    alone, at 1, 2 and 3 threads, and matches the float64 formula."""
    rng = np.random.default_rng(5)
    g = torch.Generator().manual_seed(5)
    N, K, M = 70, 256, 300  # 300 x 256 values: several rows' worth of quantizing per thread
    raw = random_rows(qtype, N, K, rng)
    packed = ops.cpu_linear_gguf_pack([torch.from_numpy(raw)], int(qtype))
    codes, d, m = INT8_FIELDS[qtype](raw, N, K)
    x = torch.randn(M, K, generator=g)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(ops.cpu_linear_gguf(x, packed, int(qtype), N, int8_activations=True))
        alone = [ops.cpu_linear_gguf(x[i : i + 1], packed, int(qtype), N, int8_activations=True)
                 for i in (0, 151, M - 1)]  # fmt: skip
    finally:
        torch.set_num_threads(before)
    for y in outs:
        assert torch.equal(y, outs[0])
        for i, one in zip((0, 151, M - 1), alone, strict=True):
            assert torch.equal(y[i], one[0]), i
    torch.testing.assert_close(outs[0].double(), int8_reference(x, codes, d, m), rtol=1e-5,
                               atol=1e-4)  # fmt: skip


def check_lora(qtype: Q, int8: bool) -> None:
    """cpu_linear_gguf's lora_a / lora_b: bitwise (x W^T + b) + (x A^T) B^T computed as three
    calls (A through the fp32 kernel's own panels), for one M tile and several; A of one vector
    panel, of a pair, of a pair and one more (its units of two and one), at ranks that fill and
    that pad the last vector; outputs enough for the threads to split the call (A's units
    computed in the product's parallel pass; from 8 rows (exact) or 16 (8-bit), t's rows split
    in a pass of their own and each few panels' terms added right after their product)."""
    from jacobi_ext.kernels.ops import cpu_linear_layout, cpu_lora_pack_a

    rng = np.random.default_rng(2)
    g = torch.Generator().manual_seed(2)
    vl = cpu_linear_layout(torch.float32)[1] // 2
    K = 512
    for N, r in ((70, 5), (600, 40), (200, vl), (130, 3 * vl)):
        packed = ops.cpu_linear_gguf_pack(
            [torch.from_numpy(random_rows(qtype, N, K, rng))], int(qtype)
        )
        a_w = torch.randn(r, K, generator=g)
        a, a_ref = cpu_lora_pack_a(a_w), ops.cpu_linear_pack(a_w)
        assert tuple(a.shape) == (-(-r // vl), K, vl)
        b = ops.cpu_linear_pack(torch.randn(N, r, generator=g))
        bias = torch.randn(N, generator=g)
        # 8 and 16: where the exact and the 8-bit call take t's rows apart (and just below);
        # 70: on 8-bit activations the AMX tile, where there is one
        for M in (1, 3, 7, 8, 13, 15, 16, 64, 70):
            x = torch.randn(M, K, generator=g)
            base = ops.cpu_linear_gguf(x, packed, int(qtype), N, bias, int8_activations=int8)
            want = base + ops.cpu_linear(ops.cpu_linear(x, a_ref, r), b, N)
            got = ops.cpu_linear_gguf(x, packed, int(qtype), N, bias, a, b, int8_activations=int8)
            assert torch.equal(got, want), (N, r, M)
    with pytest.raises(ValueError, match="go together"):
        ops.cpu_linear_gguf(x, packed, int(qtype), N, bias, a, None)
    with pytest.raises(ValueError, match="cpu_lora_pack_a"):  # A in the NR-wide panels of B
        ops.cpu_linear_gguf(x, packed, int(qtype), N, bias, a_ref, b)


@pytest.mark.parametrize(
    "qtype, int8",
    [(Q.Q4_1, False), (Q.Q6_K, False), (Q.Q4_1, True), (Q.Q8_0, True)],
    ids=["Q4_1", "Q6_K", "Q4_1-int8", "Q8_0-int8"],
)
def test_lora_inside_the_call_is_the_lora_beside_it(qtype, int8):
    check_lora(qtype, int8)


def test_pack_of_several_is_their_concatenation(tmp_path):
    rng = np.random.default_rng(1)
    a, b = random_rows(Q.Q4_1, 40, 64, rng), random_rows(Q.Q4_1, 24, 64, rng)
    both = ops.cpu_linear_gguf_pack([torch.from_numpy(a), torch.from_numpy(b)], int(Q.Q4_1))
    cat = ops.cpu_linear_gguf_pack([torch.from_numpy(np.concatenate([a, b]))], int(Q.Q4_1))
    assert torch.equal(both, cat)


def _q4_1(n=4):
    return ops.cpu_linear_gguf_pack([torch.zeros(n, 20, dtype=torch.uint8)], 3)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ops.cpu_linear_gguf_pack([torch.zeros(4, 22, dtype=torch.uint8)], 6),
         "ggml type 6 is not read by the GGUF linear kernels; they read Q4_0"),
        (lambda: ops.cpu_linear_gguf_pack([torch.zeros(4, 19, dtype=torch.uint8)], 3),
         "not a whole number of 20-byte blocks"),
        (lambda: ops.cpu_linear_gguf_pack([torch.zeros(4, 20)], 3), "must have dtype Byte"),
        (lambda: ops.cpu_linear_gguf(torch.zeros(1, 32, dtype=torch.bfloat16), _q4_1(), 3, 4),
         "x must be float32"),
        (lambda: ops.cpu_linear_gguf(torch.zeros(1, 64), _q4_1(), 3, 4),
         "packs to"),
    ],
    ids=["type", "row-bytes", "raw-dtype", "x-dtype", "shape"],
)  # fmt: skip
def test_errors_say_what_is_wrong(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- models built on the codes --------------------------------------------------------------


def _build(tmp_path, tied=False, family="llama"):
    from jacobi_ext.models.quantized import build_on_codes

    cfg = tiny_config(tied=tied, family=family)
    path = write_tiny_model(tmp_path / "tiny.gguf", cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_on_codes(cfg, path)
    return cfg, path, model, caught


@pytest.mark.parametrize(
    "tied, family", [(False, "llama"), (True, "llama"), (False, "qwen2"), (False, "qwen3")]
)
def test_model_on_codes_is_the_dequantized_model(tmp_path, tied, family):
    from jacobi_ext.decoding import prepack
    from jacobi_ext.models.quantized import GGUFEmbedding, GGUFLinear, describe

    cfg, path, model, caught = _build(tmp_path, tied, family)
    ref = dequantized_model(cfg, path)
    # Only the two types the kernels do not read fall back, with one warning naming both.
    msgs = [str(w.message) for w in caught if "do not read yet" in str(w.message)]
    assert len(msgs) == 1 and "F16 (1 tensors)" in msgs[0] and "Q5_0 (1 tensors)" in msgs[0]
    layers = model.model.layers
    assert isinstance(model.model.embed_tokens, GGUFEmbedding)
    assert isinstance(model.lm_head, GGUFLinear)
    assert type(layers[1].self_attn.o_proj) is torch.nn.Linear  # F16: dequantized
    assert layers[1].self_attn.q_proj.group is layers[1].self_attn.v_proj.group is not None
    assert "Q4_K" in describe(model)
    # No parameter of the model holds a quantized weight in fp32.
    n_float = sum(p.numel() for p in model.parameters())
    assert n_float < 3 * cfg.hidden_size * cfg.intermediate_size
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), prepack.packed(model), prepack.packed(ref):
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_codes_sit_in_one_arena_in_the_order_a_forward_reads_them(tmp_path):
    """attach_gguf gathers every linear's packed codes into one cpu_weight_arena buffer, in module
    order (the layers' q/k/v, o, gate/up, down, then the head), each group's members still views
    of the group's codes; gathering again moves them to a new buffer with the same logits."""
    from jacobi_ext.decoding import prepack
    from jacobi_ext.models.quantized import GGUFLinear, gather_weights

    _cfg, _path, model, _ = _build(tmp_path)
    mods = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    arena = mods[0].packed.untyped_storage().data_ptr()
    assert {m.packed.untyped_storage().data_ptr() for m in mods} == {arena}
    starts = [m.packed.data_ptr() for m in mods]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert mods[-1] is model.lm_head
    for m in mods:
        if m.group is not None:  # q/k/v and gate/up: one kernel call reads the group's codes
            assert m.group.packed.untyped_storage().data_ptr() == arena
            lo, hi = m.group.packed.data_ptr(), m.group.packed.data_ptr() + m.group.packed.numel()
            assert lo <= m.packed.data_ptr() < hi
    if sys.platform == "linux":
        assert arena % (2 << 20) == 0
    ids = torch.randint(
        0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1)
    )
    with torch.inference_mode(), prepack.packed(model):
        before = model(ids).logits
    assert gather_weights(model) >= sum(m.packed.numel() for m in mods if m.group is None)
    assert mods[0].packed.untyped_storage().data_ptr() != arena
    with torch.inference_mode(), prepack.packed(model):
        assert torch.equal(model(ids).logits, before)


def test_weight_arena_op():
    ops = torch.ops.jacobi_ext
    a = ops.cpu_weight_arena(3 << 20)
    assert a.dtype == torch.uint8 and a.shape == (3 << 20,) and a.device.type == "cpu"
    a.fill_(7)
    assert int(a[-1]) == 7 and int(a.sum()) == 7 * (3 << 20)
    if sys.platform == "linux":
        assert a.data_ptr() % (2 << 20) == 0
    assert ops.cpu_weight_arena(0).numel() == 0
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        ops.cpu_weight_arena(-1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])
def test_embedding_rows_are_the_gguf_packages_values(qtype):
    """GGUFEmbedding's rows (Q8_0 natively: cpu_gguf_q8_0_rows, the others through `gguf`) are
    bitwise the `gguf` package's dequantization, for ids in any shape with repeats; random bytes
    (finite scales)."""
    from jacobi_ext.models.quantized import GGUFEmbedding

    g = np.random.default_rng(3)
    dim, vocab = 96, 37
    block, size = quants.GGML_QUANT_SIZES[qtype]
    raw = g.integers(0, 256, size=(vocab, dim // block * size), dtype=np.uint8)
    scales = raw.reshape(vocab, -1, size)[..., :4].view(np.float16)  # d (and Q4_1's m)
    scales[...] = g.normal(0, 0.1, size=scales.shape).astype(np.float16)
    emb = GGUFEmbedding(raw, int(qtype), dim)
    ids = torch.tensor([[5, 0, 36, 5], [2, 2, 17, 30]])
    want = quants.dequantize(raw[ids.reshape(-1).numpy()], qtype).reshape(2, 4, dim)
    got = emb(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 4, dim)
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32)))


def test_q8_0_rows_op_every_scale_and_bad_input():
    """cpu_gguf_q8_0_rows on every fp16 scale the file may hold (subnormal, inf, NaN: random
    bytes) is the `gguf` package's value (NaN where it is NaN); ids out of range and rows that are
    not whole blocks are errors that say so; the op's schema and fake kernel agree."""
    g = np.random.default_rng(4)
    raw = g.integers(0, 256, size=(300, 3 * 34), dtype=np.uint8)
    ids = torch.from_numpy(g.integers(0, 300, size=(5, 7)))
    got = ops.cpu_gguf_q8_0_rows(torch.from_numpy(raw), ids)
    with np.errstate(invalid="ignore"):  # inf scales times zero codes: NaN, as ours
        want = quants.dequantize(raw[ids.reshape(-1).numpy()], Q.Q8_0).reshape(5, 7, 96)
    want = torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32))
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match=r"ids\[1\] = 300 is outside the 300 rows"):
        ops.cpu_gguf_q8_0_rows(torch.from_numpy(raw), torch.tensor([3, 300]))
    with pytest.raises(ValueError, match="whole Q8_0 blocks of 34 bytes"):
        ops.cpu_gguf_q8_0_rows(torch.zeros(4, 35, dtype=torch.uint8), torch.tensor([0]))
    finite = raw.copy()  # opcheck compares outputs without equal_nan
    finite.reshape(300, 3, 34)[..., :2].view(np.float16)[...] = 0.25
    torch.library.opcheck(
        torch.ops.jacobi_ext.cpu_gguf_q8_0_rows.default, (torch.from_numpy(finite), ids)
    )


@pytest.mark.parametrize("alignment", [None, 64])
def test_scan_reads_the_header_as_gguf_does(tmp_path, alignment):
    """scan_gguf (the header alone, metadata values skipped) gives exactly what gguf's own reader
    gives of the tensors and the architecture: a file with metadata of every kind (strings,
    arrays of strings and of numbers, nested arrays), tensors of every kernel type, fp32 / fp16
    ones and a type the kernels do not read, a custom alignment; a file that is not GGUF is an
    error."""
    from gguf import GGUFWriter

    from jacobi_ext.models.quantized import _scan_with_reader, scan_gguf

    g = np.random.default_rng(5)
    path = tmp_path / "meta.gguf"
    w = GGUFWriter(str(path), "qwen2")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i} \u00fc" for i in range(3000)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    w.add_array("nested", [[1, 2, 3], [4, 5]])
    w.add_uint64("a.u64", 7)
    w.add_bool("a.bool", True)
    w.add_float64("a.f64", 0.5)
    for i, qtype in enumerate([Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0]):
        block = 256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32
        w.add_tensor(f"t{i}", random_rows(qtype, 3 + i, 2 * block, g), raw_dtype=qtype)
    w.add_tensor("norm", g.normal(size=(7,)).astype(np.float32))
    w.add_tensor("half", g.normal(size=(5, 3)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got, want = scan_gguf(path), _scan_with_reader(path)
    assert got == want and got[0] == "qwen2" and len(got[1]) == 9
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError):
        scan_gguf(tmp_path / "not.gguf")


@pytest.mark.slow
def test_config_and_tokenizer_come_back_from_the_cache(tmp_path, monkeypatch):
    """A GGUF file's transformers config and tokenizer, parsed once and then read from the
    cache, are the parsed ones: the same config, the same ids for text and for the chat
    template, the same special tokens; a damaged cache is parsed again."""
    from jacobi_ext.models import default_model_file
    from jacobi_ext.models.quantized import _meta_dir, config_and_tokenizer

    monkeypatch.setenv("JACOBI_EXT_CACHE", str(tmp_path))
    path = default_model_file()
    cfg, tok = config_and_tokenizer(path)  # parsed, then saved
    assert (_meta_dir(path) / "tokenizer_config.json").is_file()
    cfg2, tok2 = config_and_tokenizer(path)  # from the cache
    assert cfg2.to_dict() == cfg.to_dict()
    text = "def f(x):\n    return x  # \u00fc \u4e2d\u6587\t<|im_end|> end"
    msgs = [{"role": "user", "content": text}]
    for t in (tok, tok2):
        assert t.eos_token == "<|im_end|>"
    assert tok2(text).input_ids == tok(text).input_ids
    assert tok2.apply_chat_template(msgs, add_generation_prompt=True) == tok.apply_chat_template(
        msgs, add_generation_prompt=True
    )
    assert (tok2.eos_token_id, tok2.bos_token_id, len(tok2)) == (
        tok.eos_token_id, tok.bos_token_id, len(tok),
    )  # fmt: skip
    (_meta_dir(path) / "config.json").write_text("{not json")
    cfg3, tok3 = config_and_tokenizer(path)
    assert cfg3.to_dict() == cfg.to_dict() and tok3(text).input_ids == tok(text).input_ids


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decoding_on_codes_equals_ar_and_the_dequantized_model(tmp_path, family):
    """Decoding from the file's codes (the exact mode) returns the tokens of the model
    dequantized to fp32, for every method: Llama, and Qwen3 (q/k norms) through the fused
    path."""
    from jacobi_ext import generate
    from jacobi_ext.decoding import lean

    cfg, path, model, _ = _build(tmp_path, family=family)
    assert lean.why_not(model) is None
    ref = dequantized_model(cfg, path)
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    ar = generate(ref, ids, max_new_tokens=40, method="ar").tokens
    for method in ("ar", "jacobi", "multiblock"):
        got = generate(model, ids, max_new_tokens=40, method=method, block_size=8).tokens
        assert torch.equal(got, ar), method


def test_int8_activations_decode_exactly_their_own_ar(tmp_path):
    """On 8-bit activations (with a float16 K/V cache, unless asked otherwise) the logits change
    (another arithmetic), but a row's bits still do not depend on the other rows of a forward:
    every method returns exactly that mode's `ar`, in a batch too; switching back restores the
    exact model's tokens and cache."""
    from jacobi_ext import generate
    from jacobi_ext.decoding.tuning import model_key
    from jacobi_ext.models.quantized import describe, set_int8_activations

    cfg, path, model, _ = _build(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    exact = generate(model, ids, max_new_tokens=40, method="ar").tokens
    with torch.inference_mode():
        before = model(ids).logits
    key = model_key(model)
    assert set_int8_activations(model) >= 1 and "int8 activations" in describe(model)
    assert model_key(model) != key  # the tuner measures this mode's own curve
    with torch.inference_mode():
        assert not torch.equal(model(ids).logits, before)  # the mode is in effect
    ar = generate(model, ids, max_new_tokens=40, method="ar").tokens
    cache = model._jacobi_runtime.cache.layers  # llama.cpp's default cache type goes with it
    assert {lay.keys.dtype for lay in cache} == {torch.float16} and "fp16 K/V" in describe(model)
    runs = {
        "jacobi": dict(method="jacobi", block_size=8),
        "jacobi lookup": dict(method="jacobi", block_size=16, lookup=True),
        "multiblock": dict(method="multiblock", block_size=4, num_blocks=3, pool_size=2),
        "tuned default": {},
    }
    for name, kw in runs.items():
        assert torch.equal(generate(model, ids, max_new_tokens=40, **kw).tokens, ar), name
    one = generate(model, ids[1:], max_new_tokens=40, method="jacobi", block_size=8).tokens
    assert torch.equal(one[0, : one.shape[1]], ar[1, : one.shape[1]])
    set_int8_activations(model, False)
    assert torch.equal(generate(model, ids, max_new_tokens=40, method="ar").tokens, exact)
    assert {lay.keys.dtype for lay in model._jacobi_runtime.cache.layers} == {torch.float32}
    set_int8_activations(model, fp16_kv_cache=False)  # 8-bit activations, fp32 K/V cache
    assert torch.equal(generate(model, ids, max_new_tokens=40, method="jacobi").tokens, (
        generate(model, ids, max_new_tokens=40, method="ar").tokens
    ))  # fmt: skip
    assert {lay.keys.dtype for lay in model._jacobi_runtime.cache.layers} == {torch.float32}


def test_int8_activations_need_q4_1_codes():
    from jacobi_ext.models import tiny_llama
    from jacobi_ext.models.quantized import set_int8_activations

    with pytest.raises(ValueError, match="int8 activations run on Q4_1 / Q8_0 GGUF codes"):
        set_int8_activations(tiny_llama(vocab_size=50, hidden_size=32, num_layers=1))


def _write_adapter(folder: Path, model, r=4, alpha=8, seed=0) -> Path:
    """A peft-format LoRA adapter (bf16) on every q/k/v/o/gate/up/down of the model."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    state = {}
    for name, m in model.named_modules():
        if name.rpartition(".")[2] in targets:
            key = f"base_model.model.{name}"
            state[f"{key}.lora_A.weight"] = (
                0.1 * torch.randn(r, m.in_features, generator=g)
            ).bfloat16()
            state[f"{key}.lora_B.weight"] = (
                0.1 * torch.randn(m.out_features, r, generator=g)
            ).bfloat16()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets)}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def test_lora_stays_unmerged_and_every_method_equals_ar(tmp_path):
    from jacobi_ext import generate
    from jacobi_ext.decoding import prepack
    from jacobi_ext.models.quantized import GGUFLinear, attach_lora

    cfg, path, model, _ = _build(tmp_path)
    ref = dequantized_model(cfg, path)
    adapter = _write_adapter(tmp_path / "adapter", ref)
    with pytest.raises(ValueError, match="not a GGUF linear"):  # o_proj of layer 1 is F16
        attach_lora(model, adapter)
    state = json.loads((adapter / "adapter_config.json").read_text())
    state["target_modules"] = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    keep = {k: v for k, v in tensors.items() if not any(t in k for t in ("o_proj", "down_proj"))}
    save_file(keep, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps(state))
    cfg2, path2, model, _ = _build(tmp_path / "again")
    attach_lora(model, adapter)
    targeted = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    targeted = [m for m in targeted if m.name.rpartition(".")[2] in state["target_modules"]]
    assert targeted and all(m.lora is not None for m in targeted)
    # The factors sit in the codes' arena, each linear's A before its codes and its B after.
    arena = targeted[0].packed.untyped_storage().data_ptr()
    for m in targeted:
        h = m.group or m
        assert {t.untyped_storage().data_ptr() for t in (m.lora.a, m.lora.b, h.lora.b)} == {arena}
        assert h.lora.a.data_ptr() < h.packed.data_ptr() < h.lora.b.data_ptr()
    # The reference: the adapter merged in float64 into the dequantized weights.
    scale = 8 / 4
    with torch.no_grad():
        for k, a in keep.items():
            if ".lora_A." in k:
                name = k.removeprefix("base_model.model.").split(".lora_A.")[0]
                b = keep[k.replace("lora_A", "lora_B")]
                lin = ref.get_submodule(name)
                lin.weight.copy_((lin.weight.double() + b.double() @ a.double() * scale).float())
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode(), prepack.packed(model), prepack.packed(ref):
        got, want = model(ids).logits, ref(ids).logits
    # Unmerged (x A^T B^T s beside W x) against merged: float32 rounding apart, far less than
    # what the adapter itself moves.
    scale_err = (got - want).abs().max() / want.abs().max()
    with torch.inference_mode(), prepack.packed(model):
        for m in targeted:
            m.lora, kept = None, m.lora
            m.lora_kept = kept
        base = model(ids).logits
        for m in targeted:
            m.lora = m.lora_kept
    moved = (base - want).abs().max() / want.abs().max()
    assert scale_err < 1e-4 and moved > 100 * scale_err, (scale_err, moved)
    ar = generate(model, ids, max_new_tokens=40, method="ar").tokens
    for method in ("jacobi", "multiblock"):
        got = generate(model, ids, max_new_tokens=40, method=method, block_size=8).tokens
        assert torch.equal(got, ar), method


def _native_and_python_logits(model, monkeypatch):
    """Logits of a prefill and of steps of 5, 1 and 5 tokens after it (a fresh runtime), through
    the layers in one C++ call (LeanLayers, its buffers kept from call to call) and through the
    same ops called from Python (JACOBI_EXT_NATIVE=0)."""
    from jacobi_ext.decoding import lean
    from jacobi_ext.decoding.runtime import StaticRuntime

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=g)
    pad = torch.tensor([0, 3])
    drafts = torch.randint(0, model.config.vocab_size, (2, 4), generator=g)
    keep = lambda logits, pos: logits.clone()  # noqa: E731  (the rule sees the raw logits)
    got = {}
    for native in ("1", "0"):
        monkeypatch.setenv("JACOBI_EXT_NATIVE", native)
        rt = StaticRuntime(model, 2, 64, 16)
        out = [rt.prefill(ids, pad, drafts, rule=keep, all_targets=True)]
        with torch.inference_mode():
            assert (lean.lean_decoder(model).native is not None) == (native == "1")
            for q in (5, 1, 5):
                rt.ids[:, :q] = torch.arange(q)[None] + 7 + q
                rt.seg[:, :q] = 0
                rt.off[:, :q] = torch.arange(q)[None]
                out.append(rt.forward(q, rt.scratch + ids.shape[1], rule=keep))
        got[native] = out
    return got["1"], got["0"]


@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_native_layers_on_codes_are_the_python_loop_bitwise(tmp_path, int8, lora, monkeypatch):
    """The default model's shape (every linear Q4_1, grouped; a Q8_0 head), exact and on 8-bit
    activations, with and without an unmerged LoRA: the layers run from C++ into the buffers
    LeanLayers keeps give the bits of the same ops called one by one from Python, at every
    width, the buffers reused and remade as the width changes."""
    from gguf_fixtures import Q4_1_LAYERS

    from jacobi_ext.models.quantized import attach_lora, build_on_codes, set_int8_activations

    monkeypatch.setenv("JACOBI_EXT_FUSED", "1")
    cfg = tiny_config()
    path = write_tiny_model(tmp_path / "q4_1.gguf", cfg, head_type=Q.Q8_0,
                            layer_types=Q4_1_LAYERS)  # fmt: skip
    model = build_on_codes(cfg, path)
    if lora:
        attach_lora(model, _write_adapter(tmp_path / "adapter", dequantized_model(cfg, path)))
    if int8:
        assert set_int8_activations(model) >= 1
    native, python = _native_and_python_logits(model, monkeypatch)
    for a, b in zip(native, python, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(native[1], native[3])  # the same step again, after a width change
    assert not torch.equal(native[1][:, :1], native[2])  # (another token: other logits)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
def test_layers_in_one_parallel_region_are_each_op_in_its_own_bitwise(
    tmp_path, int8, threads, monkeypatch
):
    """LeanLayers runs its layers in one parallel region (csrc/cpu/team.h: the kernels' chunks
    posted to threads held for the call); JACOBI_EXT_CPU_TEAM=0 gives each kernel its own region,
    as at::parallel_for does. The same bits at 2 and 3 threads, with an unmerged LoRA (its x A^T
    computed by lead chunks that the others wait on inside a chunk), at every width; and an
    error raised inside the region reaches the caller, the next call running as before."""
    from gguf_fixtures import Q4_1_LAYERS

    from jacobi_ext.decoding import executors, lean
    from jacobi_ext.models.quantized import attach_lora, build_on_codes, set_int8_activations

    monkeypatch.setenv("JACOBI_EXT_FUSED", "1")
    cfg = tiny_config()
    path = write_tiny_model(tmp_path / "q4_1.gguf", cfg, head_type=Q.Q8_0,
                            layer_types=Q4_1_LAYERS)  # fmt: skip
    model = build_on_codes(cfg, path)
    attach_lora(model, _write_adapter(tmp_path / "adapter", dequantized_model(cfg, path)))
    if int8:
        set_int8_activations(model)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = {}
        for team in ("1", "0"):
            monkeypatch.setenv("JACOBI_EXT_CPU_TEAM", team)
            got[team] = _native_and_python_logits(model, monkeypatch)[0]
        for a, b in zip(got["1"], got["0"], strict=True):
            assert torch.equal(a, b)
        monkeypatch.setenv("JACOBI_EXT_NATIVE", "1")
        monkeypatch.setenv("JACOBI_EXT_CPU_TEAM", "1")
        with torch.inference_mode():
            native = lean.lean_decoder(model).native
            kv, hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
            keys = [torch.zeros(1, kv, 32, hd) for _ in range(native.size())]
            values = [torch.zeros_like(k) for k in keys]
            kts = [executors.keys_transposed(k) for k in keys]
            h = torch.randn(1, 1, cfg.hidden_size)
            cos, sin = torch.ones(1, 1, hd), torch.zeros(1, 1, hd)
            mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)

            def run(ks):
                return native.run(h, h, cos, sin, ks, values, kts, torch.tensor([0]), 1, mask, 0)

            ok = run(keys)
            with pytest.raises((RuntimeError, ValueError), match="k_cache must be"):
                run([*keys[:-1], torch.zeros(1, kv + 1, 32, hd)])  # the last layer's: wrong
            assert torch.equal(run(keys), ok)
    finally:
        torch.set_num_threads(old)


def test_training_a_model_on_codes_says_to_dequantize(tmp_path):
    _, _, model, _ = _build(tmp_path)
    x = torch.randn(1, 3, 256, requires_grad=True)
    with pytest.raises(RuntimeError, match="dequantize=True"):
        model.model.layers[0].self_attn.q_proj(x)


@pytest.mark.slow
def test_default_model_on_codes_equals_dequantized():
    """The default model (Q4_1 + Q8_0): loaded on its codes by default, bitwise the logits of
    transformers' dequantized load through the fp32 kernel, and the same tokens."""
    from jacobi_ext import generate
    from jacobi_ext.decoding import prepack
    from jacobi_ext.models import load_model
    from jacobi_ext.models.quantized import describe, is_quantized

    model, tok = load_model()
    ref, _ = load_model(dequantize=True)
    assert is_quantized(model) and not is_quantized(ref)
    assert describe(model) == "Q4_1 x 210, Q8_0 x 1"
    ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
    with torch.inference_mode(), prepack.packed(model), prepack.packed(ref):
        assert torch.equal(model(ids).logits, ref(ids).logits)
    a = generate(ref, ids, max_new_tokens=32, method="ar").tokens
    for method in ("ar", "jacobi", "multiblock"):
        assert torch.equal(generate(model, ids, max_new_tokens=32, method=method).tokens, a)


def test_grouped_lora_panels_read_their_own_columns_bitwise():
    """lora_panel_r0: each panel of B reads rank columns of x A^T from its offset; bitwise the
    block-diagonal B over all the columns (the zeros add nothing), and the offsets are checked."""
    rng = np.random.default_rng(4)
    g = torch.Generator().manual_seed(4)
    from jacobi_ext.kernels.ops import cpu_linear_layout, cpu_lora_pack_a

    nr = cpu_linear_layout(torch.float32)[1]
    vl = nr // 2
    parts, r, K = (2 * nr, nr, 3 * nr), 5, 64
    N = sum(parts)
    packed = ops.cpu_linear_gguf_pack([torch.from_numpy(random_rows(Q.Q4_1, N, K, rng))], 3)
    a = torch.randn(3 * r, K, generator=g)
    b_parts = [torch.randn(n, r, generator=g) for n in parts]
    dense = torch.zeros(N, 3 * r)
    n0 = 0
    for i, (n, b) in enumerate(zip(parts, b_parts, strict=True)):
        dense[n0 : n0 + n, i * r : (i + 1) * r] = b
        n0 += n
    compact = torch.cat(b_parts)
    r0 = torch.tensor([i * r for i, n in enumerate(parts) for _ in range(n // nr)])
    pa = cpu_lora_pack_a(a)
    for M in (1, 4, 13):
        x = torch.randn(M, K, generator=g)
        want = ops.cpu_linear_gguf(x, packed, 3, N, None, pa, ops.cpu_linear_pack(dense))
        got = ops.cpu_linear_gguf(x, packed, 3, N, None, pa, ops.cpu_linear_pack(compact), r0)
        assert torch.equal(got, want), M
    with pytest.raises(ValueError, match="outside x A"):
        bad = r0.clone()  # past x A^T's columns, its padding included (A packed in panels of vl)
        bad[-1] = -(-3 * r // vl) * vl - r + 1
        ops.cpu_linear_gguf(x, packed, 3, N, None, pa, ops.cpu_linear_pack(compact), bad)
    with pytest.raises(ValueError, match="lora_panel_r0 must be"):
        ops.cpu_linear_gguf(x, packed, 3, N, None, pa, ops.cpu_linear_pack(compact), r0[:-1])


@pytest.mark.parametrize("offsets", [False, True])
def test_bf16_lora_factors_are_their_fp32_values_bitwise(offsets):
    """LoRA factors kept in bf16 (an adapter's stored dtype): widened exactly in the kernel, so
    the outputs are bitwise those of the same values in fp32, at every M; mixed dtypes refused."""
    from jacobi_ext.kernels.ops import cpu_linear_layout, cpu_lora_pack_a
    from jacobi_ext.models.quantized import _panels

    rng = np.random.default_rng(5)
    g = torch.Generator().manual_seed(5)
    nr = cpu_linear_layout(torch.float32)[1]
    N, K, r = 3 * nr, 96, 7
    packed = ops.cpu_linear_gguf_pack([torch.from_numpy(random_rows(Q.Q4_1, N, K, rng))], 3)
    a = torch.randn(3 * r if offsets else r, K, generator=g).bfloat16().float()
    b = torch.randn(N, r, generator=g).bfloat16().float()
    r0 = torch.tensor([0, r, 2 * r]) if offsets else None
    a32, b32 = cpu_lora_pack_a(a, torch.float32), _panels(b, torch.float32)
    assert torch.equal(b32, ops.cpu_linear_pack(b))
    a16, b16 = cpu_lora_pack_a(a, torch.bfloat16), _panels(b, torch.bfloat16)
    for M in (1, 4, 13):
        x = torch.randn(M, K, generator=g)
        want = ops.cpu_linear_gguf(x, packed, 3, N, None, a32, b32, r0)
        got = ops.cpu_linear_gguf(x, packed, 3, N, None, a16, b16, r0)
        assert torch.equal(got, want), M
    with pytest.raises(ValueError, match="must both be float32 or both bfloat16"):
        ops.cpu_linear_gguf(x, packed, 3, N, None, a16, b32, r0)
