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


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-Q{c[4]}")
def test_host_walk_matches_float64(checker, case):
    B, Hq, Hkv, D, Q, cap, ctx = case
    qkv, cos, sin, kc, vc, seg, off, lo, hi = make_case(B, Hq, Hkv, D, Q, cap, ctx, torch.float32)
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
    mask = step_mask(seg, off, lo, hi, cap)[:, 0]
    G = Hq // Hkv
    kk = kc.double().repeat_interleave(G, dim=1)
    vv = vc.double().repeat_interleave(G, dim=1)
    scores = torch.einsum("bqhd,bhkd->bhqk", q.double(), kk) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    want = torch.einsum("bhqk,bhkd->bqhd", scores.softmax(-1), vv)
    torch.testing.assert_close(got.view(B, Q, Hq, D), want, rtol=1e-4, atol=1e-5)
