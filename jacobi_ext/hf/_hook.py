"""Registers ``attn_implementation="jacobi"`` with transformers without importing it eagerly.

Importing ``transformers.modeling_utils`` costs seconds, so ``import jacobi_ext`` must not do it.
If it is already imported we register at once; otherwise a one-shot import hook registers right
after ``transformers.modeling_utils`` finishes executing (before any model can be built).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_TARGET = "transformers.modeling_utils"


def _register() -> None:
    from . import register

    register()


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
