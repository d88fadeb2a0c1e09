"""_C exports no libstdc++ symbol and carries no libstdc++ code of its own (.ci/check_cxx_runtime.py
says why: a GPU machine's build crashed inside such a copy). The installed _C is stripped: its
export table is what is checked here; CI checks the build folder's unstripped one too."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import jacobi_ext  # noqa: F401  (installs the package's finder, if editable)

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "check_cxx_runtime.py"


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("nm") is None,
    reason="binutils' nm on Linux",
)
def test_c_exports_no_libstdcxx_symbols() -> None:
    # (where the import system finds it: beside the package, or an editable install's build)
    so = importlib.util.find_spec("jacobi_ext._C").origin
    out = subprocess.run([sys.executable, str(SCRIPT), so], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"ok {so}" in out.stdout
