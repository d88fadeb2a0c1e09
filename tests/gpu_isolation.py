"""Runs each CUDA test (marked `gpu`) in a child pytest process under a timeout.

A kernel that waits forever on an mbarrier hangs the process that launched it, and no Python-level
timeout can interrupt a CUDA call. Run in the suite's own process, such a test would stall every
test after it; run in a child, it fails alone after its timeout (the child is killed, and with it
its CUDA context) and the suite goes on.

Timeouts: 60 s per test (one kernel test is a few seconds on a GPU), raised per test with
`@pytest.mark.gpu_timeout(seconds)` for the tests that compile (torch.compile / FlexAttention:
300 s) or capture CUDA graphs (180 s).

Environment:
  JACOBI_GPU_ISOLATION=0      run gpu tests in-process (debugging with pdb, say);
  JACOBI_GPU_ISOLATION=force  isolate them even without a visible CUDA device (the CPU test of
                              this mechanism, tests/test_gpu_isolation.py, uses it);
  JACOBI_GPU_CHILD=1          set in the child: it runs the test itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

DEFAULT_TIMEOUT_S = 60.0
CHILD_ENV = "JACOBI_GPU_CHILD"
MODE_ENV = "JACOBI_GPU_ISOLATION"


def isolation_enabled(cuda_available: bool) -> bool:
    """Whether gpu tests run in children in this process (never inside a child)."""
    if os.environ.get(CHILD_ENV) == "1":
        return False
    mode = os.environ.get(MODE_ENV, "1")
    if mode == "force":
        return True
    return mode != "0" and cuda_available


def timeout_of(item: pytest.Item) -> float:
    mark = item.get_closest_marker("gpu_timeout")
    return float(mark.args[0]) if mark is not None and mark.args else DEFAULT_TIMEOUT_S


def _child_outcome(junit: Path) -> tuple[str, str]:
    """(passed | failed | skipped, message) of the single test in a child's JUnit report."""
    case = ET.parse(junit).getroot().find(".//testcase")
    if case is None:
        return "failed", "the child pytest collected no test"
    for tag in ("failure", "error"):
        node = case.find(tag)
        if node is not None:
            return "failed", (node.get("message") or "") + "\n" + (node.text or "")
    node = case.find("skipped")
    if node is not None:
        return "skipped", node.get("message") or "skipped in the child"
    return "passed", ""


def run_isolated(item: pytest.Item, timeout_s: float) -> tuple[str, str]:
    """Runs item's node id in a child pytest (same interpreter, same rootdir, same options that
    decide what runs) and returns its (outcome, message); a timeout kills the child."""
    root = Path(str(item.config.rootpath))
    with tempfile.TemporaryDirectory(prefix="jacobi-gpu-child-") as tmp:
        junit = Path(tmp) / "report.xml"
        cmd = [
            sys.executable, "-m", "pytest", item.nodeid, "-q", "-p", "no:cacheprovider",
            f"--junitxml={junit}", "-o", "junit_logging=all", "-m", "",
            f"--rootdir={root}",
        ]  # fmt: skip
        env = dict(os.environ, **{CHILD_ENV: "1"})
        try:
            proc = subprocess.run(
                cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s
            )
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"")[-4000:]
            out = out.decode(errors="replace") if isinstance(out, bytes) else out
            return "failed", (
                f"timed out after {timeout_s:g} s in its child process (a hung kernel, e.g. an "
                f"mbarrier wait that never completes?); child was killed. Output so far:\n{out}"
            )
        if not junit.exists():
            return "failed", f"child pytest exited {proc.returncode} without a report:\n" + (
                proc.stdout + proc.stderr
            )[-4000:]
        outcome, msg = _child_outcome(junit)
        if outcome == "failed":
            msg = f"{msg}\n--- child output ---\n{(proc.stdout + proc.stderr)[-4000:]}"
        return outcome, msg


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "gpu_timeout(seconds): timeout of this gpu test's child process (default 60 s)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """In the parent: a gpu test's body runs in a child instead of here (fixtures still run
    here, and they only build small inputs). Returning True stops pytest's own call."""
    if "gpu" not in pyfuncitem.keywords or not isolation_enabled(_cuda_available()):
        return None
    outcome, msg = run_isolated(pyfuncitem, timeout_of(pyfuncitem))
    if outcome == "skipped":
        pytest.skip(msg)
    if outcome == "failed":
        pytest.fail(msg, pytrace=False)
    return True


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
