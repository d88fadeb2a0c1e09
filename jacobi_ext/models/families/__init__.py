"""Model families, each declared once: what a decoder layer of the family is made of, and which
transformers classes and GGUF architectures it covers. The decoding executors read these
declarations (jacobi_ext/decoding/lean.py: which modules a layer has, where the optional q/k
norms sit); adding a family is its file here plus its tests.

A layer, in the order a step runs it:
    input RMSNorm -> q/k/v projections (one fused linear; biases where `qkv_bias`) ->
    [per-head RMSNorm of q and of k, where `qk_norm`] -> rotary (the model's rotary embedding,
    its scaling included) -> attention over the step -> o projection, added to the residual ->
    post-attention RMSNorm -> gate/up projections (one fused linear) -> activation(gate) * up ->
    down projection, added to the residual.
After the last layer: the final RMSNorm and the LM head (tied to the embedding or not).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One decoder family's layer, declared."""

    name: str
    #: transformers causal-LM classes of this family (class names: no transformers import here)
    classes: tuple[str, ...]
    #: GGUF `general.architecture` values whose tensors map onto this layer
    gguf_architectures: tuple[str, ...]
    #: q/k/v projections may carry biases (Qwen2 always does; Llama where attention_bias)
    qkv_bias: bool = False
    #: an RMSNorm over each head of q and of k before the rotary (Qwen3: q_norm, k_norm)
    qk_norm: bool = False
    #: the attention modules a layer holds besides q/k/v/o (their attribute names)
    attention_extras: tuple[str, ...] = ()

    @property
    def attention_modules(self) -> int:
        """How many child modules the family's attention has (q, k, v, o and the extras)."""
        return 4 + len(self.attention_extras)


def _registry() -> dict[str, Family]:
    from . import llama, qwen2, qwen3

    return {f.name: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY)}


FAMILIES: dict[str, Family] = _registry()


def family_of(model) -> Family | None:
    """The family of a transformers causal LM (by its class name), or None."""
    name = type(model).__name__
    for fam in FAMILIES.values():
        if name in fam.classes:
            return fam
    return None


def supported_classes() -> tuple[str, ...]:
    """Every transformers class some family covers."""
    return tuple(c for fam in FAMILIES.values() for c in fam.classes)


__all__ = ["FAMILIES", "Family", "family_of", "supported_classes"]
