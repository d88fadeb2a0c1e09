"""Where jacobi_ext keeps what it measures or derives once and reads back later: the tuner's
forward-time curves and machine figures (decoding/tuning.py, tools/roofline.py) and a GGUF
file's transformers config and tokenizer (models/quantized.py). JACOBI_EXT_CACHE overrides the
place ($XDG_CACHE_HOME/jacobi_ext, else ~/.cache/jacobi_ext). Everything in it can be deleted:
it is made again when needed."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("JACOBI_EXT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jacobi_ext"
    )
    return Path(root)
