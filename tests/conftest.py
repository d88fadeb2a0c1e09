"""Shared test configuration: markers `slow` (real model) and `gpu` (needs CUDA; each gpu test
runs in a child process under a timeout, see gpu_isolation.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# The hooks of gpu_isolation.py (tests/ is on sys.path: rootdir conftest, no __init__.py).
from gpu_isolation import pytest_configure as _isolation_configure
from gpu_isolation import pytest_pyfunc_call  # noqa: F401  (a hook: pytest finds it by name)


def pytest_configure(config: pytest.Config) -> None:
    _isolation_configure(config)


def pytest_report_header(config: pytest.Config) -> str:
    """The versions a failure may depend on, first in every log (CI installs the newest
    transformers in range: a failure there names the version it met)."""
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _private_profile_cache(tmp_path_factory):
    """Tuning profiles (forward-time curves, learned acceptance) measured by the tests go to a
    directory of this session, never into the user's ~/.cache/jacobi_ext."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JACOBI_EXT_CACHE", str(tmp_path_factory.mktemp("jacobi_ext_cache")))
        yield


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _run_outside_the_source_tree(tmp_path, monkeypatch) -> None:
    """Tests (and the Python subprocesses they start) run from an empty directory, so
    `import jacobi_ext` resolves to the installed package (with its compiled _C), never to the
    source folder of a checkout that was installed non-editable."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def best_isa(tmp_path_factory) -> str:
    """The best CPU kernel variant the CPU supports: what a process that asks for no cap runs
    (tests/test_cpu_linear.py, tests/test_gguf_linear.py). (A session fixture is set up before
    the per-test chdir, so it names an empty directory itself: started in a checkout's root,
    `import jacobi_ext` would find the source folder.)"""
    env = {k: v for k, v in os.environ.items() if k != "JACOBI_EXT_CPU_ISA"}
    code = "import jacobi_ext; print(jacobi_ext.CPU_ISA)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path_factory.mktemp("best_isa"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


#: The CPU kernel variants, in the order of csrc/cpu/isa.h (each includes the one before).
ISAS = ("baseline", "avx2", "avx512")


@pytest.fixture
def in_isa_process(best_isa, tmp_path):
    """run(isa, code): the Python source `code` (this folder on sys.path, jacobi_ext imported) in
    a process of its own whose kernels are `isa`'s, capped to what the CPU has (asserted there);
    the test fails with the process's stderr where the code fails."""

    def run(isa: str, code: str) -> None:
        expected = ISAS[min(ISAS.index(isa), ISAS.index(best_isa))]
        prelude = (
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "import jacobi_ext\n"
            f"assert jacobi_ext.CPU_ISA == {expected!r}, jacobi_ext.CPU_ISA\n"
        )
        env = dict(os.environ, JACOBI_EXT_CPU_ISA=isa)
        out = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True,
                             text=True, env=env, cwd=tmp_path)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]

    return run
