"""Qwen3: Llama's layer with an RMSNorm over each head of q and of k (q_norm, k_norm, weights of
head_dim) between the projections and the rotary, as vLLM's qwen3.py adds to Qwen2's."""

from . import Family

FAMILY = Family(
    name="qwen3",
    classes=("Qwen3ForCausalLM",),
    gguf_architectures=("qwen3",),
    qkv_bias=True,  # (config.attention_bias: usually off)
    qk_norm=True,
    attention_extras=("q_norm", "k_norm"),
)
