"""Loads the compiled operators (jacobi_ext._C); when that fails, says what is wrong and what
fixes it. Every message names what it found (folders, torch versions) and only proposes a fix
that addresses that cause."""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

import torch

_PKG = Path(__file__).resolve().parents[1]  # jacobi_ext/, where _C and _build_info are installed


def _has_extension(pkg: Path) -> bool:
    return any((pkg / f"_C{s}").is_file() for s in importlib.machinery.EXTENSION_SUFFIXES)


def _source_root() -> Path | None:
    """The checkout this package folder belongs to, if it is one (not an installed copy)."""
    root = _PKG.parent
    try:
        pyproject = (root / "pyproject.toml").read_text()
    except OSError:
        return None
    return root if (root / "csrc").is_dir() and 'name = "jacobi_ext"' in pyproject else None


def _installed_elsewhere() -> list[Path]:
    """Built jacobi_ext packages on sys.path other than this one."""
    found = []
    for entry in sys.path:
        pkg = Path(entry or os.curdir).resolve() / "jacobi_ext"
        if pkg != _PKG and pkg not in found and _has_extension(pkg):
            found.append(pkg)
    return found


def _build_cmd(editable: bool = False) -> str:
    """The pip command that (re)builds jacobi_ext against the torch that is running now."""
    cmd = "pip install --no-build-isolation " + (
        "-e ." if editable else "--no-deps --force-reinstall ."
    )
    if importlib.util.find_spec("scikit_build_core") is None:
        cmd = "pip install -r requirements/build.txt && " + cmd
    return cmd


def _built_with() -> str | None:
    """The torch version this package's _C was built against, from the file CMake wrote next to
    it (readable even when _C itself cannot be loaded); None when there is no such file."""
    try:
        from .. import _build_info
    except ImportError:
        return None
    return _build_info.TORCH_VERSION


def _same_release(a: str, b: str) -> bool:
    return a.split("+")[0] == b.split("+")[0]


def _explain_load_failure(exc: ImportError) -> str:
    running = torch.__version__
    root = _source_root()
    where = f"in {root}" if root else "in the jacobi_ext source folder"
    if not _has_extension(_PKG):
        if root is None:
            return (
                f"jacobi_ext at {_PKG} has no compiled extension (jacobi_ext._C): the installation "
                f"is incomplete. Reinstall it, {where}: {_build_cmd()}"
            )
        here = "the current directory" if Path.cwd().resolve() == root else "on sys.path"
        head = (
            f"`import jacobi_ext` found the source folder {_PKG} ({root} is {here}), not an "
            "installed jacobi_ext, and a source folder has no compiled extension (jacobi_ext._C)."
        )
        editable = (
            f"to import it from {root} itself, install it there in editable mode: "
            f"{_build_cmd(editable=True)}"
        )
        installed = _installed_elsewhere()
        if installed:
            return (
                f"{head} It shadows the installed jacobi_ext at {installed[0]}. Run Python from "
                f"another directory than {root}, or, {editable}"
            )
        return (
            f"{head} No built jacobi_ext is installed either. Install it: `bash install.sh` in "
            f"{root} (see README), then run Python from another directory; or, {editable}"
        )
    built = _built_with()
    if built is not None and not _same_release(built, running):
        return (
            f"jacobi_ext was built against torch {built}, but torch {running} is installed, and "
            f"the compiled extension does not load with it ({exc}). Rebuild it against torch "
            f"{running}, {where}: {_build_cmd()}"
        )
    return (
        f"jacobi_ext's compiled extension in {_PKG} could not be loaded: {exc}. (It was built "
        f"against torch {built or '(unknown)'}; torch {running} is running.)"
    )


try:
    from .. import _C  # noqa: F401  (importing registers torch.ops.jacobi_ext.*)
except ImportError as exc:
    raise ImportError(_explain_load_failure(exc)) from exc

BUILT_WITH_TORCH: str = _C.torch_version
WITH_CUDA: bool = bool(_C.with_cuda)
CUDA_ARCHS: str = getattr(_C, "cuda_archs", "")  # "sm_80, sm_90a"; "" without CUDA kernels
# "full" (every dtype and head dim), "ci" (bf16 only), "gate" (bf16, head dim 128); "" without CUDA
CUDA_KERNEL_SET: str = getattr(_C, "cuda_kernel_set", "")
CPU_ISA: str = _C.cpu_isa
# The 8-bit-activation tile of the GGUF linear: "avx512-vnni-vbmi", "avx512-vnni", "avx2" or
# "scalar" (the same bits)
CPU_INT8_TILE: str = _C.cpu_int8_tile


@functools.cache
def build_id() -> str:
    """A digest of the compiled extension's bytes: what a cached measurement of its kernels (the
    tuner's profiles) is valid for. A rebuilt or upgraded extension gets new measurements."""
    import hashlib

    try:
        return hashlib.sha1(Path(_C.__file__).read_bytes()).hexdigest()[:12]
    except (OSError, AttributeError, TypeError):
        return "unknown"


def cuda_note() -> str | None:
    """Why this build has no CUDA kernels, as its CMake configure found ("" when it has them;
    None when the build left no record)."""
    try:
        from .. import _build_info
    except ImportError:
        return None
    return _build_info.CUDA_NOTE


if not _same_release(BUILT_WITH_TORCH, torch.__version__):
    _root = _source_root()
    raise ImportError(
        f"jacobi_ext was built against torch {BUILT_WITH_TORCH}, but torch {torch.__version__} "
        "is installed; the C++ ABI differs between releases. Rebuild it against torch "
        f"{torch.__version__}, {f'in {_root}' if _root else 'in the jacobi_ext source folder'}: "
        f"{_build_cmd()}"
    )

ops = torch.ops.jacobi_ext
