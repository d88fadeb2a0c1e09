"""The isolation of gpu tests (tests/gpu_isolation.py), checked on the CPU: a throw-away test
project whose `gpu` tests are forced into child processes (JACOBI_GPU_ISOLATION=force). A test that
sleeps past its timeout stands for a kernel hung on an mbarrier: it must fail alone, within about
its timeout, while the tests around it keep their own outcomes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS_DIR)!r})
from gpu_isolation import pytest_configure, pytest_pyfunc_call  # noqa: F401

def pytest_configure(config):  # noqa: F811
    import gpu_isolation
    gpu_isolation.pytest_configure(config)
    config.addinivalue_line("markers", "gpu: isolated")
"""

TESTS = """
import os
import time
import pytest

@pytest.mark.gpu
@pytest.mark.gpu_timeout(2)
def test_hangs():
    time.sleep(900)

@pytest.mark.gpu
def test_passes():
    assert os.environ["JACOBI_GPU_CHILD"] == "1"  # the body really ran in the child

@pytest.mark.gpu
def test_fails():
    assert 1 + 1 == 3, "wrong on purpose"

@pytest.mark.gpu
def test_skips():
    pytest.skip("no device in the child")

def test_in_process():
    assert "JACOBI_GPU_CHILD" not in os.environ
"""


def run_project(
    tmp_path: Path, mode: str, tests: str = TESTS
) -> tuple[subprocess.CompletedProcess, float]:
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_fake_gpu.py").write_text(textwrap.dedent(tests))
    env = {k: v for k, v in os.environ.items() if k != "JACOBI_GPU_CHILD"}
    env["JACOBI_GPU_ISOLATION"] = mode
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", f"--rootdir={tmp_path}",
         "-c", os.devnull, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    return proc, time.monotonic() - t0


def test_hung_test_fails_alone_after_its_timeout(tmp_path):
    proc, elapsed = run_project(tmp_path, "force")
    out = proc.stdout
    assert "FAILED test_fake_gpu.py::test_hangs" in out, out
    assert "timed out after 2 s" in out, out
    assert "PASSED test_fake_gpu.py::test_passes" in out, out
    assert "FAILED test_fake_gpu.py::test_fails" in out and "wrong on purpose" in out, out
    assert "SKIPPED" in out and "no device in the child" in out, out
    assert "PASSED test_fake_gpu.py::test_in_process" in out, out
    assert "2 failed, 2 passed, 1 skipped" in out, out
    # The sleeping child was killed at its timeout, not waited for (900 s). The bound leaves room
    # for five child pytests starting on a loaded 2-core box (50 s was exceeded under load).
    assert elapsed < 300, elapsed


def test_isolation_off_runs_in_process(tmp_path):
    """JACOBI_GPU_ISOLATION=0: bodies run in the suite's process (the marker alone does nothing),
    so the child-only assertion fails there: proof that the forced run above used children."""
    proc, _ = run_project(tmp_path, "0", TESTS.replace("time.sleep(900)", "pass"))
    assert "FAILED test_fake_gpu.py::test_passes" in proc.stdout, proc.stdout
    assert "PASSED test_fake_gpu.py::test_hangs" in proc.stdout, proc.stdout


def test_timeouts_of_the_real_gpu_tests():
    """The compile-heavy and CUDA-graph tests carry their longer timeouts; the rest get 60 s."""
    import gpu_isolation

    assert gpu_isolation.DEFAULT_TIMEOUT_S == 60
    marked = {}
    for f in TESTS_DIR.glob("test_*.py"):
        lines = f.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("@pytest.mark.gpu_timeout("):
                name = next(x for x in lines[i:] if x.startswith("def "))
                seconds = re.match(r"@pytest\.mark\.gpu_timeout\((\d+)\)", line).group(1)
                marked[name.split("(")[0][4:]] = int(seconds)
    assert marked.get("test_compiled_step_is_lossless_on_cuda") == 300, marked
    assert marked.get("test_flex_fallback_matches_reference") == 300, marked
    assert marked.get("test_cuda_graph_runtime_is_lossless") == 180, marked
    assert marked.get("test_the_whole_step_is_one_graph_replay") == 180, marked
