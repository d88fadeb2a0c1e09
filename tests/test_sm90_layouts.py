"""The host-side pieces of the sm_90a forward, checked on the CPU against Python references
(built so that it is right the first time a GPU runs it).

tests/cpp/sm90_host_check.cpp is compiled here with the system C++ compiler (and, for the CuTe
register views, with nvcc and the CUTLASS headers when both exist) and run on:
  - block tables (JF variants, random tables): the stream order and the forward tile lists with
    their bit masks that the op's host side builds (jacobi/attention_plan.h, tile_list.h), against
    a Python restatement of the heavy-path block order and a dense mask;
  - score rows (random, with masked entries and fully masked rows): the online softmax of
    jacobi/online_softmax.h walked tile by tile with a quad's partial sums, against logsumexp;
  - the register views of fwd_sm90.h (S accumulator reused as the A operand of P V, rowcol) and
    of bwd_sm90.h (S^T / dP^T reused as A operands of dV / dK, rowcol, transposed smem views).
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "tests" / "cpp" / "sm90_host_check.cpp"
INCLUDES = [f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc'}"]


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> Path:
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("sm90") / "sm90_host_check"
    subprocess.run([cxx, "-std=c++17", "-O1", *INCLUDES, str(SRC), "-o", str(exe)], check=True)
    return exe


def run(exe: Path, mode: str, text: str) -> list[str]:
    r = subprocess.run([str(exe), mode], input=text, capture_output=True, text=True, check=True)
    return r.stdout.splitlines()


# ---- Python references -------------------------------------------------------------------------
def heavy_path_order(starts, ptr, idx) -> list[int]:
    """attention_plan.h's block order, restated: pred(b) = last fully visible block; chains follow
    the child with the tallest subtree (ties: lowest index), emitted in order of their heads."""
    nb = len(starts) - 1
    pred = [idx[ptr[b + 1] - 1] if ptr[b + 1] > ptr[b] else -1 for b in range(nb)]
    height = [1] * nb
    for b in reversed(range(nb)):
        if pred[b] >= 0:
            height[pred[b]] = max(height[pred[b]], height[b] + 1)
    heavy = [-1] * nb
    for b in range(nb):
        p = pred[b]
        if p >= 0 and (heavy[p] < 0 or height[b] > height[heavy[p]]):
            heavy[p] = b
    order = []
    for b in range(nb):
        if pred[b] >= 0 and heavy[pred[b]] == b:
            continue
        x = b
        while x >= 0:
            order.append(x)
            x = heavy[x]
    return order


def dense_mask(starts, ptr, idx, S) -> torch.Tensor:
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


def jf_table(P, n, T, variant, w=1):
    """The JF block table, restated from docs/method.md §1 (prompt block 0, then noisy_j /
    clean_j)."""
    blocks = ([("p", -1)] if P else []) + [(k, j) for j in range(T) for k in ("n", "c")]
    starts = [0]
    for kind, _ in blocks:
        starts.append(starts[-1] + (P if kind == "p" else n))
    ptr, idx = [0], []
    for qb, (qk, qj) in enumerate(blocks):
        for kb, (kk, kj) in enumerate(blocks[:qb]):
            if kk == "p":
                ok = True
            elif qk == "c":
                ok = kk == "c"
            else:
                i0 = {"noisy_context": 0, "clean_context": qj, "windowed": (qj // w) * w}[variant]
                ok = kj < i0 if kk == "c" else kj >= i0
            if ok:
                idx.append(kb)
        ptr.append(len(idx))
    return starts, ptr, idx


def random_table(rng: random.Random):
    nb = rng.randint(1, 7)
    sizes = [rng.randint(0, 40) for _ in range(nb)]
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    ptr, idx = [0], []
    for b in range(nb):
        idx += sorted(rng.sample(range(b), rng.randint(0, b)))
        ptr.append(len(idx))
    return starts, ptr, idx, starts[-1] + rng.choice([0, 0, 5])  # sometimes an uncovered tail


def check_plan(exe, starts, ptr, idx, S, tm, tn):
    nb = len(starts) - 1
    text = " ".join(map(str, [nb, *starts, *ptr, *idx, S, tm, tn]))
    lines = run(exe, "plan", text)
    perm = [int(x) for x in lines[0].split()[1:]]
    # Stream order: blocks in heavy-path order, each block's tokens in order, uncovered tail last.
    want = [t for b in heavy_path_order(starts, ptr, idx) for t in range(starts[b], starts[b + 1])]
    want += list(range(starts[-1], S))
    assert perm == want
    mp = dense_mask(starts, ptr, idx, S)[perm][:, perm]
    nq, nk = math.ceil(S / tm), math.ceil(S / tn)
    padded = torch.zeros(nq * tm, nk * tn, dtype=torch.bool)
    padded[:S, :S] = mp
    entries = [[int(x) for x in ln.split()[1:]] for ln in lines[1:] if ln.startswith("entry")]
    listed = {(e[0], e[1]): e for e in entries}
    # The deterministic dQ's order (tile_list.h dq_turn, walked over the backward lists as the
    # sm_90a backward walks them): key tile j's turn on query tile i is j's rank among the key
    # tiles listed for i, so the turns of each query tile are 0, 1, ... in ascending key order.
    turns = [[int(x) for x in ln.split()[1:]] for ln in lines[1:] if ln.startswith("turn")]
    assert sorted((i, j) for i, j, _ in turns) == sorted(listed), "one turn per listed pair"
    for i, j, t in turns:
        assert t == sorted(jj for ii, jj in listed if ii == i).index(j), f"turn of ({i}, {j})"

    for i in range(nq):
        js = [e[1] for e in entries if e[0] == i]
        assert js == sorted(set(js)), "ascending key tiles, no repeats"
        for j in range(nk):
            sub = padded[i * tm : min((i + 1) * tm, S), j * tn : (j + 1) * tn]
            if not sub.any():
                assert (i, j) not in listed, f"fully masked pair ({i}, {j}) listed: it would load"
                continue
            e = listed[(i, j)]
            if bool(sub.all()):
                assert e[2] == -1, f"fully visible pair ({i}, {j}) carries a mask"
                continue
            assert e[2] >= 0, f"partial pair ({i}, {j}) marked fully visible"
            words = torch.tensor(e[3:], dtype=torch.int64).reshape(tm, tn // 32)
            bits = ((words[:, :, None] >> torch.arange(32)) & 1).bool().reshape(tm, tn)
            assert torch.equal(bits, padded[i * tm : (i + 1) * tm, j * tn : (j + 1) * tn])
    return entries


@pytest.mark.parametrize(
    "P,n,T,variant,w",
    [
        (100, 16, 12, "noisy_context", 1),
        (0, 32, 9, "clean_context", 1),
        (64, 64, 5, "windowed", 2),
        (37, 24, 7, "clean_context", 1),
    ],
)
def test_jf_stream_order_and_tile_lists(checker, P, n, T, variant, w):
    starts, ptr, idx = jf_table(P, n, T, variant, w)
    S = starts[-1]
    entries = check_plan(checker, starts, ptr, idx, S, 128, 128)
    order = heavy_path_order(starts, ptr, idx)
    pre = [0] if P else []
    noisy = [len(pre) + 2 * j for j in range(T)]
    clean = [len(pre) + 2 * j + 1 for j in range(T)]
    if variant == "noisy_context":  # exactly two causal streams (attention_plan.h)
        assert order == pre + noisy + clean
    # The point of the lists: fully masked pairs (above the causal diagonal) are never loaded.
    nq = math.ceil(S / 128)
    assert len(entries) <= nq * (nq + 1) // 2 < nq * nq


@pytest.mark.parametrize("seed", range(12))
def test_random_tables(checker, seed):
    rng = random.Random(seed)
    starts, ptr, idx, S = random_table(rng)
    tm, tn = rng.choice([(128, 128), (64, 32), (16, 64)])
    check_plan(checker, starts, ptr, idx, S, tm, tn)


@pytest.mark.parametrize("tile", [1, 7, 32, 200])
def test_online_softmax_matches_logsumexp(checker, tile):
    g = torch.Generator().manual_seed(tile)
    rows, n, scale = 9, 150, 0.37
    x = torch.randn(rows, n, generator=g, dtype=torch.float64) * 6
    x[torch.rand(rows, n, generator=g) < 0.3] = -math.inf
    x[3] = -math.inf  # a row that sees nothing: lse -inf, weights 0
    x[5, :140] = -math.inf  # sees only its last tile
    x[6, 0] = 40.0  # a large first max, then smaller ones
    text = f"{rows} {n} {tile}\n" + "\n".join(
        " ".join("-inf" if math.isinf(v) else f"{v:.9g}" for v in r.tolist()) for r in x
    )
    got = torch.tensor(
        [[float(v) for v in ln.split()[1:]] for ln in run(checker, "softmax", text)],
        dtype=torch.float64,
    )
    lse_want = torch.logsumexp(scale * x, dim=1)
    p_want = torch.softmax(scale * x, dim=1).nan_to_num(0.0)
    assert math.isinf(got[3, 0]) and got[3, 0] < 0 and torch.all(got[3, 1:] == 0)
    torch.testing.assert_close(got[:, 0][lse_want.isfinite()], lse_want[lse_want.isfinite()],
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(got[:, 1:], p_want, rtol=1e-4, atol=1e-6)


def test_register_views_of_the_sm90_kernel(tmp_path):
    """The S accumulator reinterpreted as the A operand of P V holds, in every thread's slot,
    the element the wgmma expects there (both head dims); rowcol() rows are rows, columns pair.
    The backward's S^T / dP^T as A operands of dV / dK likewise, and its transposed views."""
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    spec = importlib.util.find_spec("cutlass_library")
    if nvcc is None or spec is None:
        pytest.skip("needs nvcc and the CUTLASS headers (pip install --no-deps nvidia-cutlass)")
    cutlass = Path(spec.submodule_search_locations[0]) / "source" / "include"
    exe = tmp_path / "sm90_host_check_cute"
    subprocess.run(
        [nvcc, "-std=c++17", "-O1", "--expt-relaxed-constexpr", "-x", "cu", "-DJACOBI_WITH_CUTE",
         *INCLUDES, "-isystem", str(cutlass), str(SRC), "-o", str(exe)],
        check=True,
    )  # fmt: skip
    r = subprocess.run([str(exe), "fragments"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fragments D=64: 256 threads, 0 bad" in r.stdout
    assert "fragments D=128: 256 threads, 0 bad" in r.stdout
    assert "bwd fragments D=64: 256 threads, 0 bad" in r.stdout
    assert "bwd fragments D=128: 256 threads, 0 bad" in r.stdout
