"""The engine's own next-draft rule and context-lookup index, loaded without importing jacobi_ext.

Importing any `jacobi_ext.*` module runs jacobi_ext/__init__.py, which loads the compiled
extension and installs a transformers hook: nothing a vLLM worker should pay for or be changed
by. The two files needed here (jacobi_ext/decoding/next_draft.py and lookup.py) use the
standard library only, so they are loaded by their paths as modules of this package. Where
jacobi_ext lies is found with importlib.util.find_spec, which for a top-level name locates the
package without running it (an editable install's finder included); a sibling folder of this
package (the same wheel, or a source checkout on sys.path) is the fallback.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_FILES = {"next_draft": "next_draft.py", "lookup": "lookup.py"}


def _decoding_dirs() -> list[Path]:
    dirs: list[Path] = []
    spec = importlib.util.find_spec("jacobi_ext")
    if spec is not None and spec.submodule_search_locations:
        dirs += [Path(p) / "decoding" for p in spec.submodule_search_locations]
    dirs.append(Path(__file__).resolve().parents[1] / "jacobi_ext" / "decoding")
    return dirs


def _load(name: str):
    full = f"{__package__}._{name}"
    if full in sys.modules:
        return sys.modules[full]
    for d in _decoding_dirs():
        path = d / _FILES[name]
        if path.is_file():
            spec = importlib.util.spec_from_file_location(full, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[full] = module
            spec.loader.exec_module(module)
            return module
    raise ImportError(
        f"jacobi_vllm needs jacobi_ext/decoding/{_FILES[name]} (from the jacobi_ext "
        f"distribution, which ships this package); looked in {[str(d) for d in _decoding_dirs()]}"
    )


next_draft = _load("next_draft")
lookup = _load("lookup")
accepted_length = next_draft.accepted_length
next_main_row = next_draft.next_main_row
NgramIndex = lookup.NgramIndex
LookupPolicy = lookup.LookupPolicy
