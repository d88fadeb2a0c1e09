"""Jacobi decoding inside vLLM: a `custom_class` speculative proposer (docs/serving.md).

    from vllm import LLM
    llm = LLM(model=DIR, dtype="float32",
              speculative_config={"model": "jacobi_vllm.JacobiProposer",
                                  "num_speculative_tokens": 15})

A small pure-Python package shipped in the jacobi_ext distribution, separate from jacobi_ext so
that vLLM's worker imports none of jacobi_ext (its __init__ loads the compiled extension): the
next-draft rule and the lookup index it shares with the engine are loaded by file
(jacobi_vllm._rules). `JacobiProposer` (jacobi_vllm.proposer) and the wrapper that records the
target's predictions (jacobi_vllm.hook) import vLLM; importing this package alone does not.
"""

from __future__ import annotations

__all__ = ["JacobiProposer"]


def __getattr__(name: str):
    if name == "JacobiProposer":
        from .proposer import JacobiProposer

        return JacobiProposer
    raise AttributeError(f"module 'jacobi_vllm' has no attribute {name!r}")
