"""transformers' custom generation method: Jacobi / multi-block decoding with jacobi_ext.

`model.generate(..., custom_generate=<the folder above this one>, trust_remote_code=True)` and
models exported by `jacobi-forcing export` run `generate` below. It lives in the installed
jacobi_ext (requirements.txt), so every copy of this folder decodes with the installed engine.
"""

from jacobi_ext.hf.custom_generate.method import generate

__all__ = ["generate"]
