"""Llama, and the families whose layer is Llama's: SmolLM (a LlamaForCausalLM) and Mistral
without a sliding window (the executors refuse a layer with one)."""

from . import Family

FAMILY = Family(
    name="llama",
    classes=("LlamaForCausalLM", "MistralForCausalLM"),
    gguf_architectures=("llama", "mistral"),
    qkv_bias=True,  # (config.attention_bias: usually off)
)
