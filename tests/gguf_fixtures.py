"""Tiny GGUF files the tests write themselves with the `gguf` package: random codes of every type
the GGUF kernels read (and a few they do not), as whole Llama models or as loose tensors."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

# The types the kernels read (csrc/cpu/linear_gguf_cpu.h).
KERNEL_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Where each type keeps its fp16 scale fields (byte offsets in a block): every other byte of a
# block is a code or a small integer scale, any value valid.
_HALF_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.Q5_0: (0,),
}  # fmt: skip


def random_rows(qtype: Q, N: int, K: int, rng: np.random.Generator, scale=0.02) -> np.ndarray:
    """N rows of K weights of `qtype` as the file stores them (uint8 [N, bytes per row]): random
    codes, random finite fp16 scales (both signs, some subnormal)."""
    bk, bb = GGML_QUANT_SIZES[qtype]
    assert K % bk == 0, (qtype, K)
    nb = K // bk
    raw = rng.integers(0, 256, size=(N, nb, bb), dtype=np.uint8)
    for off in _HALF_FIELDS[qtype]:
        h = rng.normal(0, scale, size=(N, nb)) * rng.choice([1, 1, 1, 1e-3], size=(N, nb))
        raw[:, :, off : off + 2] = h.astype(np.float16).view(np.uint8).reshape(N, nb, 2)
    return raw.reshape(N, nb * bb)


def write_tensors(path: Path, tensors: dict, arch: str = "llama") -> Path:
    """A GGUF file holding `tensors`: name -> (raw uint8 [N, bytes] and its type, logical
    (N, K)), or name -> a float32 / float16 numpy array."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), arch)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            raw, qtype, shape = t
            w.add_tensor(name, raw, raw_dtype=qtype)  # the logical shape follows from the bytes
            assert (
                raw.shape[1] // GGML_QUANT_SIZES[qtype][1] * GGML_QUANT_SIZES[qtype][0] == shape[1]
            )
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Per layer, per linear, the type its tensor gets in the tiny model's file: every kernel type
# alone (layer 0), fused q/k/v and gate/up of one type (layer 1), and two types the kernels do
# not read (F16 and Q5_0), which run dequantized.
LAYER_TYPES = (
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q4_K,
     "ffn_gate": Q.Q5_K, "ffn_up": Q.Q6_K, "ffn_down": Q.Q4_K},
    {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q4_K, "attn_output": Q.F16,
     "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q5_0},
)  # fmt: skip


def tiny_config(tied: bool = False, family: str = "llama"):
    """A Llama (Qwen2, Qwen3) config whose every linear has K a multiple of 256 (k-quants'
    block)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    extra = {"head_dim": 64} if family == "qwen3" else {}  # (Qwen3Config's default is 128)
    return cls(
        **extra,
        vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip


# The default model's types (SmolLM2's Q4_1 file): every linear of a layer Q4_1, so that the
# loader groups q/k/v and gate/up (with a Q8_0 head: write_tiny_model(head_type=Q.Q8_0)).
Q4_1_LAYERS = tuple({name: Q.Q4_1 for name in types} for types in LAYER_TYPES)


def write_tiny_model(path: Path, config, seed: int = 0, embed_type=Q.Q8_0, head_type=Q.Q6_K,
                     layer_types=LAYER_TYPES):  # fmt: skip
    """A GGUF file of random codes for `config` (tiny_config), in llama.cpp's tensor names;
    layer i's tensors of the types layer_types[i] gives."""
    rng = np.random.default_rng(seed)
    H, FF, V = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = H // config.num_attention_heads
    shapes = {
        "attn_q": (H, H), "attn_k": (config.num_key_value_heads * hd, H),
        "attn_v": (config.num_key_value_heads * hd, H), "attn_output": (H, H),
        "ffn_gate": (FF, H), "ffn_up": (FF, H), "ffn_down": (H, FF),
    }  # fmt: skip

    def tensor(qtype, shape):
        if qtype == Q.F16:
            return (rng.normal(0, 0.05, size=shape)).astype(np.float16)
        return (random_rows(qtype, *shape, rng), qtype, shape)

    def norm():
        return (1 + 0.1 * rng.normal(size=H)).astype(np.float32)

    tensors = {"token_embd.weight": tensor(embed_type, (V, H)), "output_norm.weight": norm()}
    if not config.tie_word_embeddings:
        tensors["output.weight"] = tensor(head_type, (V, H))
    for i, types in enumerate(layer_types):
        tensors[f"blk.{i}.attn_norm.weight"] = norm()
        tensors[f"blk.{i}.ffn_norm.weight"] = norm()
        for name, qtype in types.items():
            tensors[f"blk.{i}.{name}.weight"] = tensor(qtype, shapes[name])
        if getattr(config, "model_type", "") == "qwen2":
            for name in ("attn_q", "attn_k", "attn_v"):
                tensors[f"blk.{i}.{name}.bias"] = rng.normal(0, 0.1, shapes[name][0]).astype(
                    np.float32
                )
        if getattr(config, "model_type", "") == "qwen3":  # per-head q/k norms (head_dim)
            for name in ("attn_q_norm", "attn_k_norm"):
                tensors[f"blk.{i}.{name}.weight"] = (1 + 0.3 * rng.normal(size=hd)).astype(
                    np.float32
                )
    model_type = getattr(config, "model_type", "")
    arch = model_type if model_type in ("qwen2", "qwen3") else "llama"
    return write_tensors(path, tensors, arch=arch)


def dequantized_model(config, path: Path):
    """The model as transformers loads the file: every tensor dequantized by `gguf`, then passed
    through transformers' own tensor processor (its reordering of q and k rows), in fp32."""
    from gguf import GGUFReader, quants
    from transformers import AutoModelForCausalLM

    from jacobi_ext.models.quantized import _processor_and_map

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32).eval()
    reader = GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor, names = _processor_and_map(model, arch)  # transformers' own processor
    state = {}
    for t in reader.tensors:
        w = quants.dequantize(t.data, t.tensor_type)
        w = processor.process(weights=w, name=t.name).weights
        state[names[t.name]] = torch.from_numpy(np.array(w, dtype=np.float32))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model
