"""The CUDA decode attention's walk restated on the host (tests/cpp/decode_host_check.cpp) from
the same header functions the kernel calls (jacobi/decode_step.h, jacobi/online_softmax.h): keys
committed first then the step's own, splits and chunks, the plan's rule, the online softmax and
the split merge, against a float64 reference of the step_mask attention. Runs on any CPU."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_decode_plan_attention import CASES, make_case, rotate

from jacobi_ext.decoding.masks import step_mask

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "tests" / "cpp" / "decode_host_check.cpp"
SPLIT_KEYS = 128  # csrc/cuda/decode_cuda.h: kDecodeSplitKeys


@pytest.fixture(scope="module")
def checker(tmp_path_factory) -> Path:
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("decode") / "decode_host_check"
    inc = [f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'csrc'}"]
    subprocess.run([cxx, "-std=c++17", "-O2", *inc, str(SRC), "-o", str(exe)], check=True)
    return exe


def test_split_keys_is_the_kernels():
    text = (ROOT / "csrc" / "cuda" / "decode_cuda.h").read_text()
    assert f"constexpr int64_t kDecodeSplitKeys = {SPLIT_KEYS};" in text


def _host_walk(checker, case, lo_hi=None):
    """The host walk's output and the float64 reference of one case; lo_hi(lo, hi, Q, cap) may
    move the plan's committed ranges (the reference then attends to them clamped as
    jacobi/decode_step.h's step_committed clamps them)."""
    B, Hq, Hkv, D, Q, cap, ctx = case
    qkv, cos, sin, kc, vc, seg, off, lo, hi = make_case(B, Hq, Hkv, D, Q, cap, ctx, torch.float32)
    if lo_hi is not None:
        lo, hi = lo_hi(lo.clone(), hi.clone(), Q, cap)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    c, s = cos[:, :, None], sin[:, :, None]
    q = rotate(q.view(B, Q, Hq, D), c, s, torch.float32)
    kc[:, :, :Q] = rotate(k.view(B, Q, Hkv, D), c, s, torch.float32).transpose(1, 2)
    vc[:, :, :Q] = v.view(B, Q, Hkv, D).transpose(1, 2)
    scale = D**-0.5
    head = f"{B} {Hq} {Hkv} {D} {Q} {cap} {SPLIT_KEYS} {scale!r}\n"
    body = [" ".join(f"{x:.9g}" for x in t.reshape(-1).tolist()) for t in (q, kc, vc)]
    body += [" ".join(str(int(x)) for x in t.reshape(-1).tolist()) for t in (seg, off, lo, hi)]
    r = subprocess.run(
        [str(checker)], input=head + "\n".join(body) + "\n", capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    got = torch.tensor([float(x) for x in r.stdout.split()], dtype=torch.float64)
    lo = lo.clamp(min=Q, max=cap)  # step_committed: Q <= lo <= hi <= capacity
    hi = torch.maximum(hi.clamp(max=cap), lo)
    mask = step_mask(seg, off, lo, hi, cap)[:, 0]
    G = Hq // Hkv
    kk = kc.double().repeat_interleave(G, dim=1)
    vv = vc.double().repeat_interleave(G, dim=1)
    scores = torch.einsum("bqhd,bhkd->bhqk", q.double(), kk) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    want = torch.einsum("bhqk,bhkd->bqhd", scores.softmax(-1), vv)
    return got.view(B, Q, Hq, D), want


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-Q{c[4]}")
def test_host_walk_matches_float64(checker, case):
    got, want = _host_walk(checker, case)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _past_capacity(lo, hi, Q, cap):
    hi[0] = cap + 37  # a commit that did not fit, while hi moved (the kernel must not read it)
    return lo, hi


def _before_scratch_end(lo, hi, Q, cap):
    lo[-1] = max(Q - 3, 0)  # a committed start inside the slots the step writes
    return lo, hi


@pytest.mark.parametrize("move", [_past_capacity, _before_scratch_end], ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", CASES[1:], ids=lambda c: f"B{c[0]}-D{c[3]}-Q{c[4]}-cap{c[5]}")
def test_host_walk_clamps_out_of_range_plans(checker, case, move):
    """A plan outside [Q, capacity) reads only its own sequence's cache rows (the walk reads the
    caches through bounds-checked accessors: a read outside them fails the run) and attends to
    its range clamped, as the kernel does."""
    got, want = _host_walk(checker, case, move)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
