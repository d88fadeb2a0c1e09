"""Loads the compiled operators (jacobi_ext._C) and says clearly what to do when that fails."""

from __future__ import annotations

import torch

try:
    from . import _C  # noqa: F401  (importing registers torch.ops.jacobi_ext.*)
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    raise ImportError(
        "jacobi_ext's compiled extension (jacobi_ext._C) could not be loaded: "
        f"{exc}. Build it against the torch you run with: "
        "pip install --no-build-isolation .  (see README: Install)"
    ) from exc

BUILT_WITH_TORCH: str = _C.torch_version
WITH_CUDA: bool = bool(_C.with_cuda)
CPU_ISA: str = _C.cpu_isa

if BUILT_WITH_TORCH.split("+")[0] != torch.__version__.split("+")[0]:  # pragma: no cover
    raise ImportError(
        f"jacobi_ext was built against torch {BUILT_WITH_TORCH} but torch {torch.__version__} "
        "is installed; the C++ ABI differs between releases. Rebuild: "
        "pip install --no-build-isolation --force-reinstall --no-deps ."
    )

ops = torch.ops.jacobi_ext
