"""The `custom_generate/` folder transformers loads (`generate.py`, `requirements.txt`) and its
implementation (`hf.py`). `jacobi_ext.CUSTOM_GENERATE` is the folder that holds this one."""

from .hf import JACOBI_KEYS, generate

__all__ = ["JACOBI_KEYS", "generate"]
