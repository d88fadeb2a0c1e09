"""Qwen2 / Qwen2.5: Llama's layer with biases on the q, k and v projections."""

from . import Family

FAMILY = Family(
    name="qwen2",
    classes=("Qwen2ForCausalLM",),
    gguf_architectures=("qwen2",),
    qkv_bias=True,
)
