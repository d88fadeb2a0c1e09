"""jacobi_ext: lossless parallel decoding for autoregressive LLMs (Jacobi Forcing).

Public API (filled in by the layers below; see README):
    JacobiLayout, jacobi_attention          the block-causal training attention
    BlockTable, block_attention             the same for any block-causal layout
    jacobi_ext.hf.jacobi_layout             attn_implementation="jacobi" for transformers models
    generate                                Jacobi / multi-block decoding, same output as greedy
    left_pad                                a batch of prompts of different lengths for generate
    jacobi_ext.models.load_model            the default model (SmolLM2-135M-Instruct), offline
    CUSTOM_GENERATE                         model.generate(..., custom_generate=CUSTOM_GENERATE,
                                            trust_remote_code=True): Jacobi decoding in HF
"""

import os as _os

from ._version import __version__
from .hf import _hook
from .kernels._native import BUILT_WITH_TORCH, CPU_ISA, CUDA_ARCHS, WITH_CUDA, cuda_note
from .kernels.attention import block_attention, jacobi_attention
from .kernels.layout import BlockTable, JacobiLayout

# attn_implementation="jacobi" for transformers models, registered without importing transformers.
_hook.install()

# The folder holding `custom_generate/generate.py` (transformers' custom generation method).
CUSTOM_GENERATE: str = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "hf")

__all__ = [
    "__version__",
    "BUILT_WITH_TORCH",
    "CPU_ISA",
    "WITH_CUDA",
    "BlockTable",
    "CUSTOM_GENERATE",
    "GenerateResult",
    "JacobiLayout",
    "block_attention",
    "build_info",
    "generate",
    "jacobi_attention",
    "left_pad",
]


def __getattr__(name: str):
    # The decoding engine needs transformers (its KV cache); load it on first use so that
    # `import jacobi_ext` stays light and works where only the kernels are wanted.
    if name in ("generate", "GenerateResult", "left_pad"):
        from . import decoding

        return getattr(decoding, name)
    raise AttributeError(f"module 'jacobi_ext' has no attribute {name!r}")


def build_info() -> dict[str, object]:
    """What this installation was built with and runs on."""
    import torch

    return {
        "jacobi_ext": __version__,
        "torch (built against)": BUILT_WITH_TORCH,
        "torch (running)": torch.__version__,
        "cuda kernels": WITH_CUDA,
        "cuda archs": CUDA_ARCHS,  # "sm_80, sm_90a"; "" without CUDA kernels
        "no cuda kernels because": cuda_note(),  # what the build found; None: no record
        "cuda available": torch.cuda.is_available(),
        "cpu kernel isa": CPU_ISA,
        # GGUF tensor types the CPU linear reads as stored (jacobi_ext.models.quantized)
        "gguf types read": ", ".join(_gguf_types()) or "none",
        # ... and those it also reads on 8-bit activations (int8_activations=True)
        # (and the tile that multiplies them: amx-int8 for calls of many rows with
        # avx512-vnni-vbmi for a step's few, avx512-vnni-vbmi, avx512-vnni, avx2 or scalar:
        # the same bits)
        "gguf int8 activations": f"Q4_1, Q8_0 ({_int8_tile()})" if _gguf_types() else "none",
        "cpu threads": torch.get_num_threads(),
        # The families each executor of the step program runs (jacobi_ext/models/families,
        # jacobi_ext/decoding/executors.py); any other causal LM decodes through transformers'
        # forward.
        "model families (reference executor)": _families(),
        "model families (cpu executor)": _families(),
        "model families (cuda executor)": _families() if WITH_CUDA else "none (no CUDA kernels)",
    }


def _families() -> str:
    from .models.families import FAMILIES

    return "; ".join(f"{f.name} ({', '.join(f.classes)})" for f in FAMILIES.values())


def _int8_tile() -> str:
    from .kernels._native import CPU_INT8_TILE

    if CPU_INT8_TILE == "amx-int8":  # csrc/cpu/linear_gguf_cpu.cpp: kAmxMinRows
        return "amx-int8 tile for prefills and batches, avx512-vnni-vbmi for steps"
    return f"{CPU_INT8_TILE} tile"


def _gguf_types() -> list[str]:
    from .kernels.ops import gguf_kernel_type_names  # not .quantized: that one needs numpy

    return gguf_kernel_type_names()
