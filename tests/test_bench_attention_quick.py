"""The attention benchmark suite runs (quick mode: tiny sizes, one round), so it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_attention_quick(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, JACOBI_BENCH_QUICK="1")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        str(ROOT / "bench" / "bench_attention.py"),
        f"--benchmark-json={out}",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    infos = [b["extra_info"] for b in data["benchmarks"]]
    impls = {(e["impl"], e.get("mode")) for e in infos}
    assert {("jacobi", "fwd"), ("jacobi", "fwdbwd"), ("sdpa_dense", "fwdbwd")} <= impls
    assert ("two_pass", "fwdbwd") in impls and ("matmul", None) in impls
    for e in infos:
        assert e["gflops"] > 0
        if e["impl"] != "matmul":
            assert 0 < e["useful_fraction"] <= 1
    report = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "report.py"), str(out)],
        capture_output=True,
        text=True,
    )
    assert report.returncode == 0 and "jacobi" in report.stdout, report.stderr
