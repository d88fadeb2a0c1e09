"""The benchmark suites run (quick mode: tiny sizes, one round) so they cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SUITES = sorted(p.name for p in (ROOT / "bench").glob("bench_*.py"))


@pytest.mark.parametrize("suite", SUITES)
def test_bench_suite_runs_in_quick_mode(suite: str, tmp_path: Path) -> None:
    if "cuda" in suite and not torch.cuda.is_available():
        pytest.skip("a CUDA-only suite (needs a GPU)")
    if suite == "bench_cpu_linear.py":
        from jacobi_ext.decoding import prepack

        if not prepack.kernel_available():
            pytest.skip("this build has no CPU linear kernel")
    out = tmp_path / "bench.json"
    env = dict(os.environ, JACOBI_BENCH_QUICK="1", JACOBI_EXT_CACHE=str(tmp_path / "cache"))
    if suite == "bench_decoding.py":
        env["JACOBI_BENCH_BATCH"] = "1"  # the batch rows too (their warm-up pins the settings)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ROOT / "bench" / suite),
            f"--benchmark-json={out}",
            "-o",
            "python_files=bench_*.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmarks"], "the suite produced no benchmark"
    for b in data["benchmarks"]:
        assert b["stats"]["median"] > 0
    # The JSON says which model it measured, and the report shows it.
    assert data["machine_info"]["jacobi_bench_model"] == "tiny random Llama (quick mode)"
    # The threads a fresh process gets in this environment (OMP_NUM_THREADS, else the cores):
    # this process's own count may have been changed by an earlier test.
    fresh = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert data["machine_info"]["torch_threads"] == int(fresh.stdout)
    from jacobi_ext.apps import report

    text = report.markdown(report.load([out]), {}, {})
    assert "| model | tiny random Llama (quick mode) |" in text
    if suite == "bench_decoding.py":
        # The GPU job's figures come from these keys (issue 63): the steady step apart from the
        # prefill and captures, whole-call tokens/s, and the device read from the model.
        single = [b["extra_info"] for b in data["benchmarks"] if "test_decoding" in b["name"]]
        batch = [b["extra_info"] for b in data["benchmarks"] if "test_batch" in b["name"]]
        assert {r["method"] for r in single} >= {"hf-greedy", "ar", "jacobi", "jacobi-tuned"}
        assert len(batch) == 2
        for r in single + batch:
            for key in ("method", "steady_ms_per_step", "prefill_ms", "tokens_per_s", "device"):
                assert key in r, (key, r)
            assert r["device"] == "cpu" and r["tokens_per_s"] > 0
            if r["method"] != "hf-prompt-lookup":
                assert r["steady_ms_per_step"] > 0 and r["prefill_ms"] > 0
        for r in single:
            if r["method"] in ("ar", "jacobi", "jacobi-tuned"):
                assert r["tpf"] >= 1 and r["identical_to_ar"] and r["identical_to_greedy"]
    if suite == "bench_attention.py":
        infos = [b["extra_info"] for b in data["benchmarks"]]
        impls = {(e["impl"], e.get("mode")) for e in infos}
        assert {("jacobi", "fwd"), ("jacobi", "fwdbwd"), ("sdpa_dense", "fwdbwd")} <= impls
        assert ("two_pass", "fwdbwd") in impls and ("matmul", None) in impls
        for e in infos:
            assert e["gflops"] > 0
            if e["impl"] != "matmul":
                assert 0 < e["useful_fraction"] <= 1
        text = report.markdown(report.load([out]), {"cpu": "test"}, {})
        assert "## Training attention" in text and "| jacobi |" in text
        assert "its time / ours" in text and "x |" in text
