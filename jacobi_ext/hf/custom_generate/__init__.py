"""The `custom_generate/` folder transformers loads (`generate.py`, `requirements.txt`) and its
implementation (`method.py`). `jacobi_ext.CUSTOM_GENERATE` is the folder that holds this one."""

from .method import JACOBI_KEYS, generate

__all__ = ["JACOBI_KEYS", "generate"]
