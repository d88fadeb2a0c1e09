"""The package imports, reports how it was built, and its CLI answers."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import jacobi_ext


def test_version_and_ops_namespace() -> None:
    assert jacobi_ext.__version__.count(".") == 2
    assert hasattr(torch.ops.jacobi_ext, "verify_step")
    info = jacobi_ext.build_info()
    assert info["torch (built against)"].split("+")[0] == torch.__version__.split("+")[0]
    assert info["cpu kernel isa"] in {"baseline", "avx2", "avx512"}


def test_build_info_without_numpy() -> None:
    """torch runs without numpy (the CUDA build check installs only torch and the wheel), so
    `build_info` must too: it names the GGUF types without importing the numpy-based loader."""
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "import jacobi_ext\n"
        "print(jacobi_ext.build_info()['gguf types read'])"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "Q4_0" in run.stdout.splitlines()[-1]


def test_cli_help_and_info() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "jacobi_ext.apps.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "jacobi-forcing" in out and "info" in out
    out = subprocess.run(
        [sys.executable, "-m", "jacobi_ext", "info", "--json"],  # the package runs as the command
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert '"cpu kernel isa"' in out


def test_isa_override_is_capped_and_validated() -> None:
    code = "import jacobi_ext; print(jacobi_ext.CPU_ISA)"
    env = dict(os.environ, JACOBI_EXT_CPU_ISA="baseline")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "baseline", out.stderr
    env["JACOBI_EXT_CPU_ISA"] = "sse9"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode != 0 and "JACOBI_EXT_CPU_ISA" in out.stderr


def test_import_is_light_and_generate_is_lazy() -> None:
    code = (
        "import sys, jacobi_ext\n"
        "assert 'transformers' not in sys.modules, 'import jacobi_ext pulled in transformers'\n"
        "from jacobi_ext import generate, GenerateResult\n"
        "assert callable(generate) and 'transformers' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
