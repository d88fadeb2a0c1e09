"""A GGUF model decoded from the file's own bytes on the CPU: its linears read the quantized
codes through `torch.ops.jacobi_ext.cpu_linear_gguf` (csrc/cpu/linear_gguf_cpu.h), its token
embedding is gathered from the codes a row at a time, and no fp32 copy of those weights is made.

Why: decoding is bound by reading the weights. SmolLM2-135M's Q4_1 file holds 97 MB of weights
read per token; dequantized to fp32 they are 538 MB. Reading the file's bytes reads 5.6x fewer.

Lossless by construction: every weight the kernel dequantizes is bitwise the `gguf` package's
dequantized value (what transformers loads from the same file, rows of q and k reordered as
transformers reorders them), and each output is the fp32 kernel's chain on it. So a model loaded
here returns bitwise the logits of the same file loaded by transformers and run through our fp32
kernel, and every decoding method returns exactly our `ar`'s tokens.

What reads what (`load_gguf(path)`, or `attach_gguf(model, path)` on a transformers model loaded
from that file):
  - an `nn.Linear` whose GGUF tensor is of a type the kernels read (`kernel_types()`: Q4_0, Q4_1,
    Q8_0, Q4_K, Q5_K, Q6_K) becomes a `GGUFLinear`: the codes packed once into the kernel's
    panels, fused side by side for q/k/v and gate/up where they share a type;
  - a tied LM head reads the token embedding's codes the same way;
  - the token embedding becomes a `GGUFEmbedding`: the rows a step needs, dequantized by `gguf`;
  - any other tensor type (F16, BF16, Q5_0, Q2_K, ...) is dequantized into fp32 panels as
    transformers would load it, with one warning naming the type.
A LoRA adapter stays unmerged on top (`attach_lora`): its A and B, widened exactly to fp32, run
through the fp32 kernel beside the quantized product: y = Wq x + (B (A x)) * scale.

Only for CPU inference in float32 activations: training, autograd, other dtypes and GPUs load the
model dequantized (`load_model(..., dequantize=True)`).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..cache import cache_dir
from ..kernels.ops import GGUF_TYPE_NAMES as KERNEL_TYPE_NAMES
from ..kernels.ops import gguf_kernel_type_names as kernel_type_names
from ..kernels.ops import gguf_kernel_types as kernel_types

# Llama-shaped layers: linears fused into one kernel call where they share a type.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_Q8_0 = 8  # gguf.GGMLQuantizationType.Q8_0


def _panel_width() -> int:
    from ..kernels.ops import cpu_linear_layout

    return cpu_linear_layout(torch.float32)[1]


class _Lora:
    """An unmerged LoRA on a linear: y += B (A x) * scale, both products on the fp32 kernel's
    chain (each row computed alone, as the quantized product), run inside the GGUF linear's call
    (cpu_linear_gguf's lora_a / lora_b / lora_panel_r0). `a`, `b`: A [rank, K] and B [N, rank]
    (the scale folded in), A packed by cpu_lora_pack_a, B by cpu_linear_pack; for linears the
    loader fused, views of their group's, whose A is the members' stacked and whose B panels
    each read their own member's columns of x A^T (`panel_r0`, one per panel; None: all from
    column 0)."""

    __slots__ = ("a", "b", "rank", "out_features", "nbytes", "panel_r0")

    def __init__(self, a: torch.Tensor, b: torch.Tensor, rank: int, out_features: int,
                 nbytes: int, panel_r0: torch.Tensor | None = None) -> None:  # fmt: skip
        self.a, self.b, self.rank, self.out_features, self.nbytes = a, b, rank, out_features, nbytes
        self.panel_r0 = panel_r0

    @staticmethod
    def pack(a: torch.Tensor, b: torch.Tensor, panel_r0: torch.Tensor | None = None,
             dtype: torch.dtype = torch.float32) -> _Lora:  # fmt: skip
        """From fp32 A [rows, K] and B [N, rank], kept in `dtype` (float32, or bfloat16 where
        every value is one: the kernel widens it back exactly)."""
        from ..kernels.ops import cpu_lora_pack_a

        pa, pb = cpu_lora_pack_a(a, dtype), _panels(b, dtype)
        nbytes = pa.numel() * pa.element_size() + pb.numel() * pb.element_size()
        return _Lora(pa, pb, b.shape[1], b.shape[0], nbytes, panel_r0)

    def args(self) -> tuple:
        """cpu_linear_gguf's lora_a, lora_b, lora_panel_r0."""
        return self.a, self.b, self.panel_r0


def _panels(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight [N, K] in the kernels' panels, [ceil(N / NR), K, NR] of `dtype` (rows past N
    zero): what cpu_linear_pack gives for float32, and the same layout in bfloat16."""
    from ..kernels.ops import cpu_pack_panels

    return cpu_pack_panels(w, dtype, _panel_width())


def _group_lora(g, factors: dict, nr: int, dtype: torch.dtype) -> _Lora:
    """One LoRA for linears packed side by side (q/k/v): A stacked. Where every member fills
    whole panels, B holds each member's own rank columns and each panel reads x A^T from its
    member's offset (panel_r0); else B is block-diagonal (zeros elsewhere). The same sums either
    way (a chain never starts on or passes through a -0, so the zeros add nothing), with a third of
    the B bytes at q/k/v and half at gate/up."""
    K = g.mods[0].in_features
    ranks = [factors[m][0].shape[0] if m in factors else 0 for m in g.mods]
    offsets = [sum(ranks[:i]) for i in range(len(ranks))]
    compact = all(m.out_features % nr == 0 for m in g.mods)
    width = max(ranks) if compact else sum(ranks)
    rows = max(o + width for o in offsets) if compact else sum(ranks)
    a_all, b_all = torch.zeros(rows, K), torch.zeros(g.n, width)
    n0 = 0
    for m, r, o in zip(g.mods, ranks, offsets, strict=True):
        if r:
            col = 0 if compact else o  # where this member's rank columns sit in B
            a_all[o : o + r] = factors[m][0]
            b_all[n0 : n0 + m.out_features, col : col + r] = factors[m][1]
        n0 += m.out_features
    if not compact:
        return _Lora.pack(a_all, b_all, None, dtype)
    panels = [m.out_features // nr for m in g.mods]
    panel_r0 = [o for o, n in zip(offsets, panels, strict=True) for _ in range(n)]
    return _Lora.pack(a_all, b_all, torch.tensor(panel_r0), dtype)


class GGUFLinear(nn.Module):
    """A linear whose weight is a GGUF tensor's codes, packed for the CPU kernel. `packed` may be
    a view of a buffer packed for several linears side by side (`group`)."""

    def __init__(self, in_features: int, out_features: int, ggml_type: int, packed: torch.Tensor,
                 bias: torch.Tensor | None, name: str = "") -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.ggml_type = ggml_type
        self.type_name = KERNEL_TYPE_NAMES.get(ggml_type, str(ggml_type))
        self.register_buffer("packed", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.name = name
        self.group: _Group | None = None
        self.lora: _Lora | None = None
        self.int8 = False  # 8-bit activations (set_int8_activations)

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads: the packed codes, and the LoRA's fp32 factors."""
        return self.packed.numel() + (self.lora.nbytes if self.lora is not None else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(
                f"{self.name or 'this linear'} holds GGUF codes ({self.type_name}) for inference "
                "only; to train, load the model dequantized: load_model(..., dequantize=True)"
            )
        return torch.ops.jacobi_ext.cpu_linear_gguf(x, *self.args())

    def args(self) -> tuple:
        """cpu_linear_gguf's arguments after x."""
        lora = (None, None, None) if self.lora is None else self.lora.args()
        return (self.packed, self.ggml_type, self.out_features, self.bias, *lora, self.int8)

    def extra_repr(self) -> str:
        lora = f", lora r={self.lora.rank}" if self.lora is not None else ""
        int8 = ", int8 activations" if self.int8 else ""
        return f"{self.in_features}, {self.out_features}, {self.type_name}{lora}{int8}"


class _Group:
    """Linears packed side by side into one buffer (q/k/v, gate/up): one kernel call for all."""

    __slots__ = ("mods", "packed", "ggml_type", "n", "lora", "int8")

    def __init__(self, mods: list[GGUFLinear], packed: torch.Tensor) -> None:
        self.mods, self.packed = tuple(mods), packed
        self.ggml_type = mods[0].ggml_type
        self.n = sum(m.out_features for m in mods)
        self.lora: _Lora | None = None
        self.int8 = False


# The ggml types the kernels read on 8-bit activations (csrc/cpu/linear_gguf_cpu.h).
INT8_TYPES = (3, 8)  # Q4_1, Q8_0


#: Where a model keeps the element type chosen for its K/V cache (set_kv_cache_dtype).
_KV_ATTR = "_jacobi_ext_kv_dtype"


def set_kv_cache_dtype(model, dtype: torch.dtype | None) -> None:
    """Keep the model's K/V cache in `dtype` when it decodes on a CPU: torch.float16 (half the
    cache's bytes, llama.cpp's default cache type) or None / the model's dtype (exact: the default).

    A half cache holds each key (after its rotary embedding) and value rounded to fp16; the
    attention widens them exactly where it reads them, so its result is the fp32 attention over
    the rounded keys and values. The logits are then no longer the fp32 model's (greedy answers may
    part from transformers' at near-ties), but every decoding method still returns exactly this
    mode's own `ar` (each key is rounded alike whichever step writes it). float16 needs a
    float32 model (ValueError otherwise) and takes effect on a CPU (on a GPU the cache keeps the
    model's dtype), at the next `generate` call."""
    if dtype is not None and dtype not in (torch.float16, torch.float32):
        raise ValueError(f"a K/V cache is float16 or float32 (None: the model's), got {dtype}")
    p = next(model.parameters(), None)
    if dtype == torch.float16 and p is not None and p.dtype != torch.float32:
        raise ValueError(
            f"a float16 K/V cache goes with a float32 model on a CPU; this one is {p.dtype} "
            f"on {p.device}"
        )
    if dtype == torch.float16:
        object.__setattr__(model, _KV_ATTR, torch.float16)
    else:
        model.__dict__.pop(_KV_ATTR, None)
    model.__dict__.pop("_jacobi_ext_key", None)  # the tuner's curve: this mode's and cache's own


def kv_cache_dtype(model) -> torch.dtype:
    """The element type of the model's K/V cache when it decodes: float16 where
    set_kv_cache_dtype asked for it and the model is float32 on a CPU, else the model's dtype."""
    p = next(model.parameters(), None)
    if p is None:
        return torch.float32
    want = model.__dict__.get(_KV_ATTR)
    if want == torch.float16 and p.dtype == torch.float32 and p.device.type == "cpu":
        return torch.float16
    return p.dtype


def set_int8_activations(model, on: bool = True, fp16_kv_cache: bool | None = None) -> int:
    """Run the model's Q4_1 and Q8_0 linears (the default model's layers and its LM head) on
    8-bit activations (on=True) or exactly (on=False); with the 8-bit activations, a K/V cache
    in float16 (`fp16_kv_cache`, default: as `on`; set_kv_cache_dtype): llama.cpp's defaults.

    Exact (the default): every output is the fp32 product with the exactly dequantized weight,
    bitwise the model dequantized to fp32. On 8-bit activations (llama.cpp's kind of arithmetic):
    each row of x is quantized per block of 32 values and multiplied with the codes in
    integers, ~1.4-1.9x faster per one-row Q4_1 linear here; the logits are no longer the fp32
    model's (so greedy answers may part from transformers' at near-ties, as llama.cpp's do), but
    a row's bits do not depend on the other rows of a forward, so every decoding method still
    returns exactly this mode's own `ar`. Other tensor types stay exact. Takes effect at the next
    `generate` call. Returns how many linears it switched."""
    n = 0
    for m in model.modules():
        if isinstance(m, GGUFLinear) and m.ggml_type in INT8_TYPES:
            m.int8 = bool(on)
            n += 1
            if m.group is not None:
                m.group.int8 = bool(on)
    if on and n == 0:
        raise ValueError(
            "int8 activations run on Q4_1 / Q8_0 GGUF codes; this model has no such linear on its "
            f"codes ({describe(model)}): load a Q4_1 or Q8_0 .gguf file without dequantize=True"
        )
    half = on if fp16_kv_cache is None else fp16_kv_cache
    set_kv_cache_dtype(model, torch.float16 if half else None)  # (the tuner's key goes with it)
    return n


class GGUFEmbedding(nn.Module):
    """A token embedding read from the file's codes: the rows a call needs, dequantized by the
    `gguf` package (bitwise what transformers loads), nothing else held in fp32."""

    def __init__(self, raw: np.ndarray, ggml_type: int, dim: int) -> None:
        super().__init__()
        self.raw, self.ggml_type, self.embedding_dim = raw, ggml_type, dim
        self.num_embeddings = raw.shape[0]
        self._raw_t: torch.Tensor | None = None  # raw as a tensor, made on first use

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ggml_type == _Q8_0:
            return self._q8_0_rows(ids)
        from gguf import GGMLQuantizationType, quants

        flat = ids.reshape(-1).cpu().numpy()
        uniq, inv = np.unique(flat, return_inverse=True)
        rows = quants.dequantize(self.raw[uniq], GGMLQuantizationType(self.ggml_type))
        table = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        out = table[torch.from_numpy(inv.reshape(-1))]
        return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    def raw_tensor(self) -> torch.Tensor:
        """The file's table as a uint8 tensor [V, bytes per row] sharing its bytes."""
        if self._raw_t is None:
            with warnings.catch_warnings():  # the file's pages are read-only; we only read them
                warnings.simplefilter("ignore", UserWarning)
                self._raw_t = torch.from_numpy(self.raw)  # shares the file's bytes
        return self._raw_t

    def _q8_0_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Q8_0 rows (blocks of an fp16 scale d and 32 int8 codes q) as d * q in float32: the
        `gguf` package's own formula, so the same bits, in one native call (its numpy
        bookkeeping cost ~0.3 ms a decoding step for one token's row; ten tensor ops ~40 us)."""
        rows = torch.ops.jacobi_ext.cpu_gguf_q8_0_rows(self.raw_tensor(), ids.cpu())
        return rows.to(ids.device)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, ggml type {self.ggml_type}"


def is_quantized(model) -> bool:
    """Whether `model` decodes from GGUF codes (has GGUFLinear modules)."""
    return any(isinstance(m, GGUFLinear) for m in model.modules())


def describe(model) -> str:
    """'GGUF Q4_1 x 210, Q8_0 x 1 (+ LoRA)' or 'fp32'-style: what the model's linears read."""
    counts: dict[str, int] = {}
    lora, int8 = False, set()
    for m in model.modules():
        if isinstance(m, GGUFLinear):
            counts[m.type_name] = counts.get(m.type_name, 0) + 1
            lora = lora or m.lora is not None
            if m.int8:
                int8.add(m.type_name)
        elif type(m) is nn.Linear:
            key = str(m.weight.dtype).replace("torch.", "")
            counts[key] = counts.get(key, 0) + 1
    parts = ", ".join(f"{k} x {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    parts += " + LoRA (unmerged)" if lora else ""
    parts += f", {' and '.join(sorted(int8))} on int8 activations" if int8 else ""
    return parts + (", fp16 K/V cache" if kv_cache_dtype(model) == torch.float16 else "")


# ---- loading -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    """What the loader needs of one GGUF tensor, without the parsed file behind it."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    data_offset: int  # bytes from the file's start
    n_bytes: int
    shape: tuple  # of the stored array: [N, bytes per row] for block types
    dtype: object  # numpy dtype of the stored array

    def read(self, path: Path) -> np.ndarray:
        """The tensor's stored array, read with a plain file read into memory of our own
        (reading through the file's mapping would leave its pages resident while it lives)."""
        with open(path, "rb") as f:
            f.seek(self.data_offset)
            buf = f.read(self.n_bytes)
        return np.frombuffer(buf, dtype=self.dtype).reshape(self.shape).copy()


# GGUF metadata value types: fixed sizes (bytes) of the scalar ones; 8 = string, 9 = array.
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_ITEM = {0: np.float32, 1: np.float16, 16: np.int8, 17: np.int16, 18: np.int32,
              27: np.int64, 28: np.float64}  # fmt: skip


def scan_gguf(path: str | Path) -> tuple[str, list[_Tensor]]:
    """The file's architecture name and its tensors' records (what `gguf.GGUFReader` gives of
    them: tests compare), read from the header alone: its metadata values are skipped, not parsed
    (GGUFReader builds a numpy view per vocabulary string: seconds a load for a 49k-token
    vocabulary, where this takes a small fraction of one). A file that is not little-endian
    GGUF v2 / v3 is read with GGUFReader."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape

    path = Path(path)
    with open(path, "rb") as f:
        buf = f.read(1 << 20)
        magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", buf, 0)
        if magic != 0x46554747 or version not in (2, 3):
            return _scan_with_reader(path)
        pos = 24

        def need(n: int) -> None:  # the header is longer than what was read so far
            nonlocal buf
            while pos + n > len(buf):
                more = f.read(max(1 << 20, n))
                if not more:
                    raise ValueError(f"{path}: the GGUF header ends early")
                buf += more

        def string() -> str:
            nonlocal pos
            need(8)
            (n,) = struct.unpack_from("<Q", buf, pos)
            need(8 + n)
            pos += 8 + n
            return buf[pos - n : pos].decode("utf-8", errors="replace")

        def skip(vtype: int) -> None:
            nonlocal pos
            if vtype in _GGUF_SCALAR:
                pos += _GGUF_SCALAR[vtype]
            elif vtype == 8:
                need(8)
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            elif vtype == 9:
                need(12)
                etype, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if etype in _GGUF_SCALAR:
                    pos += count * _GGUF_SCALAR[etype]
                else:
                    for _ in range(count):
                        skip(etype)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {vtype}")

        arch, alignment = None, 32
        for _ in range(n_kv):
            key = string()
            need(4)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if key == "general.architecture" and vtype == 8:
                arch = string()
            elif key == "general.alignment" and vtype == 4:
                need(4)
                (alignment,) = struct.unpack_from("<I", buf, pos)
                pos += 4
            else:
                skip(vtype)
        infos = []
        for _ in range(n_tensors):
            name = string()
            need(4)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            need(4 + 8 * n_dims + 12)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, ttype, offset))
    if arch is None:
        raise ValueError(f"{path} names no general.architecture")
    start = -(-pos // alignment) * alignment
    tensors = []
    for name, dims, ttype, offset in infos:
        qtype = GGMLQuantizationType(ttype)
        block, size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(dims))
        shape = tuple(reversed(dims))
        dtype = _GGUF_ITEM.get(ttype)
        if dtype is None:
            dtype, shape = np.uint8, quant_shape_to_byte_shape(shape, qtype)
        tensors.append(
            _Tensor(name, qtype, start + offset, n * size // block, tuple(shape), np.dtype(dtype))
        )
    return arch, tensors


def _scan_with_reader(path: Path) -> tuple[str, list[_Tensor]]:
    """scan_gguf through gguf's own reader (every metadata value parsed, then dropped)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    tensors = [
        _Tensor(t.name, t.tensor_type, int(t.data_offset), int(t.n_bytes), tuple(t.data.shape),
                t.data.dtype)
        for t in reader.tensors
    ]  # fmt: skip
    del reader
    gc.collect()
    return arch, tensors


def _processor_and_map(model, arch_name: str):
    """transformers' own GGUF tensor processor for the file's architecture (its row reordering of
    q and k) and the map from the file's tensor names to the model's parameter names (gguf's
    name table for that architecture, looked up once: transformers' own map walks every
    submodule and rebuilds the table for each, seconds per load)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(arch_name, TensorProcessor)(config=model.config.to_dict())
    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch_name), None)
    if arch is None:
        raise NotImplementedError(f"gguf does not know the architecture {arch_name!r}")
    table = get_tensor_name_map(arch, model.config.num_hidden_layers)
    names = {}
    for hf_name in model.state_dict():
        base, dot, suffix = hf_name.rpartition(".")
        g = table.get_name(base) if suffix in ("weight", "bias") else None
        if g is not None:
            names[f"{g}.{suffix}"] = hf_name
    return processor, names


def _row_order(processor, name: str, n: int) -> np.ndarray | None:
    """The order transformers puts the rows of tensor `name` in (a permutation of range(n)), by
    running its processor on the row indices; None if it does more than reorder rows."""
    idx = np.arange(n, dtype=np.int64).reshape(n, 1)
    out = processor.process(weights=idx, name=name, tensor_key_mapping={}, parsed_parameters={})
    w = np.asarray(out.weights)
    if out.name != name or w.shape != (n, 1) or not np.array_equal(np.sort(w[:, 0]), idx[:, 0]):
        return None
    return w[:, 0]


def _dequantized(processor, t: _Tensor, path: Path) -> torch.Tensor:
    """A tensor as transformers loads it: gguf's dequantization, then its processor (fp32)."""
    from gguf import quants

    w = quants.dequantize(t.read(path), t.tensor_type)
    w = processor.process(weights=w, name=t.name, tensor_key_mapping={}, parsed_parameters={})
    return torch.from_numpy(np.array(w.weights, dtype=np.float32))


def _set(model, dotted: str, value: nn.Module) -> None:
    parent, _, child = dotted.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, value)


def attach_gguf(model, path: str | Path, verbose: bool = False, scan=None):
    """Point `model`'s linears and token embedding at the codes of the GGUF file it was loaded
    from (or built for, on the meta device), in place; every other tensor is loaded dequantized.
    Returns the model. See the module docstring for what reads what. `scan`: scan_gguf(path),
    if already made."""
    from ..kernels._native import ops

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    readable = set(kernel_types())
    if not readable:
        raise RuntimeError("this jacobi_ext build has no GGUF CPU kernel (cpu_linear_gguf)")
    arch, records = scan if scan is not None else scan_gguf(path)
    processor, names = _processor_and_map(model, arch)
    tensors = {t.name: t for t in records}
    fallback: dict[str, int] = {}
    linears: dict[str, tuple] = {}  # module path -> (tensor, rows)
    head_name = "lm_head"
    tied = getattr(model.config, "tie_word_embeddings", False)
    for gname, t in tensors.items():
        hf = names.get(gname)
        if hf is None:
            continue
        mod_path, _, leaf = hf.rpartition(".")
        mod = model.get_submodule(mod_path)
        qtype = int(t.tensor_type)
        if leaf == "weight" and type(mod) is nn.Embedding:
            if qtype in (0, 1):  # F32 / F16: an ordinary table
                mod.weight = nn.Parameter(_dequantized(processor, t, path), requires_grad=False)
            else:
                # The table's bytes read from the file, not a view of its mapping: a view would
                # keep every page of the mapped file that the packing read resident.
                raw = t.read(path)
                _set(model, mod_path, GGUFEmbedding(raw, qtype, mod.embedding_dim))
            if tied and qtype in readable:
                linears[head_name] = (t, None)
            elif tied:  # the head reads the table as the model's dtype, like any fallback
                w = mod.weight if qtype in (0, 1) else _dequantized(processor, t, path)
                model.get_submodule(head_name).weight = nn.Parameter(w, requires_grad=False)
                if qtype != 0:
                    fallback[t.tensor_type.name] = fallback.get(t.tensor_type.name, 0) + 1
            continue
        if leaf == "weight" and type(mod) is nn.Linear:
            order = _row_order(processor, gname, int(t.shape[0]))
            if qtype in readable and order is not None:
                linears[mod_path] = (t, order)
                continue
            if qtype not in (0,):  # F32 is exact as it is; anything else is worth a word
                fallback[t.tensor_type.name] = fallback.get(t.tensor_type.name, 0) + 1
        p = nn.Parameter(_dequantized(processor, t, path), requires_grad=False)
        setattr(mod, leaf, p)
    if fallback:
        warnings.warn(
            f"{path.name}: tensor types the GGUF kernels do not read yet run dequantized to fp32: "
            + ", ".join(f"{k} ({v} tensors)" for k, v in fallback.items())
            + f"; the kernels read {', '.join(kernel_type_names())}",
            stacklevel=2,
        )
    nr = _panel_width()
    done: set[str] = set()
    for layer_path in sorted({p.rpartition(".")[0] for p in linears}):
        for names_ in FUSED:
            paths = [f"{layer_path}.{n}" for n in names_]
            if all(p in linears for p in paths):
                ts = [linears[p][0] for p in paths]
                mods = [model.get_submodule(p) for p in paths]
                same = len({int(t.tensor_type) for t in ts}) == 1
                if same and all(m.out_features % nr == 0 for m in mods[:-1]):
                    rows = [_rows(path, t, linears[p][1]) for t, p in zip(ts, paths, strict=True)]
                    packed = ops.cpu_linear_gguf_pack(rows, int(ts[0].tensor_type))
                    qs, p0 = [], 0
                    for m, p, t in zip(mods, paths, ts, strict=True):
                        np_ = m.out_features // nr + (m.out_features % nr > 0)
                        q = GGUFLinear(m.in_features, m.out_features, int(t.tensor_type),
                                       packed.narrow(0, p0, np_), _bias(m), p)  # fmt: skip
                        p0 += np_
                        qs.append(q)
                        _set(model, p, q)
                        done.add(p)
                    group = _Group(qs, packed)
                    for q in qs:
                        q.group = group
    for p, (t, order) in linears.items():
        if p in done:
            continue
        m = model.get_submodule(p)
        packed = ops.cpu_linear_gguf_pack([_rows(path, t, order)], int(t.tensor_type))
        _set(model, p, GGUFLinear(m.in_features, m.out_features, int(t.tensor_type), packed,
                                  _bias(m), p))  # fmt: skip
    gather_weights(model)
    object.__setattr__(model, "gguf_file", str(path))
    if verbose:
        print(f"{path.name}: {describe(model)}")
    return model


#: where each range of the arena (a linear's codes, a LoRA factor) starts: on a cache line
_ARENA_ALIGN = 64


def gather_weights(model) -> int:
    """Move what every GGUF linear of `model` reads into one buffer, in the order a forward reads
    it (module order: each layer's q/k/v, o, gate/up, down, then the head; per linear its LoRA's
    A, its packed codes, its LoRA's B, as the kernel reads them), at a 2 MiB boundary on
    transparent huge pages where the OS grants them (cpu_weight_arena). The same bytes: every
    linear computes exactly what it did. Why: a step streams all of it once; on 4 KiB pages that
    is a TLB miss every 4 KiB and a hardware prefetcher that stops at each page's end (the codes
    gathered: a one-token step ~7 % faster, exact and 8-bit, on a 2-core EPYC; the shipped
    adapter's factors beside them: ~2 % more on 8-bit activations). Returns the buffer's bytes (0:
    nothing to gather). attach_gguf and attach_lora call it; call it again after packing more
    linears."""
    from ..kernels._native import ops

    # Byte ranges in the order a forward reads them (after an earlier gather, every linear's
    # codes are views of one storage: each range is placed on its own), and what refers to them.
    ranges: list[tuple[int, int, torch.Tensor]] = []  # (address, bytes, a tensor over them)
    users: list[tuple[object, str, torch.Tensor, int]] = []  # (holder, attribute, tensor, range)
    groups: set[int] = set()

    def use(holder, attr: str) -> None:
        t = getattr(holder, attr)
        start = t.data_ptr()
        end = start + t.element_size() * (
            1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        )
        within = (j for j, (r0, nb, _) in enumerate(ranges) if r0 <= start and end <= r0 + nb)
        i = next(within, None)  # a member's view of its group's
        if i is None:
            i = len(ranges)
            ranges.append((start, end - start, t))
        users.append((holder, attr, t, i))

    def place(h) -> None:  # a linear or a group: its LoRA's A, its codes, its LoRA's B
        if h.lora is not None:
            use(h.lora, "a")
        use(h, "packed")
        if h.lora is not None:
            use(h.lora, "b")

    for m in model.modules():
        if not isinstance(m, GGUFLinear) or m.packed.device.type != "cpu":
            continue
        # q/k/v, gate/up: the group first; its members' codes and factors are views of its own
        if m.group is not None and id(m.group) not in groups:
            groups.add(id(m.group))
            place(m.group)
        place(m)
    if not ranges:
        return 0
    at, total = [], 0  # where each range's byte 0 goes in the arena
    for _r0, nb, _t in ranges:
        at.append(total)
        total += -(-nb // _ARENA_ALIGN) * _ARENA_ALIGN
    arena = ops.cpu_weight_arena(total)
    for (r0, nb, t), a0 in zip(ranges, at, strict=True):
        st = t.untyped_storage()
        src = torch.empty(0, dtype=torch.uint8).set_(st, r0 - st.data_ptr(), (nb,))
        arena.narrow(0, a0, nb).copy_(src)
    for holder, attr, t, i in users:  # each range starts on a cache line: whole elements
        size = t.element_size()
        view = arena if size == 1 else arena.view(t.dtype)
        start = (at[i] + t.data_ptr() - ranges[i][0]) // size
        setattr(holder, attr, view.as_strided(t.shape, t.stride(), start))
    return total


def _rows(path: Path, t, order: np.ndarray | None) -> torch.Tensor:
    """A tensor's rows (uint8 [N, bytes per row]) in transformers' order."""
    data = t.read(path)
    if order is not None and not np.array_equal(order, np.arange(len(order))):
        data = data[order]
    return torch.from_numpy(np.ascontiguousarray(data))


def _bias(m: nn.Linear) -> torch.Tensor | None:
    b = getattr(m, "bias", None)
    if b is None or b.device.type == "meta":
        return None
    return b.detach().float()


def load_gguf(path: str | Path, attn_implementation: str = "sdpa"):
    """A causal LM that decodes from the GGUF file's codes (see the module docstring), and its
    tokenizer; no fp32 copy of the quantized weights is ever made."""
    from transformers import GenerationConfig

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    scan = scan_gguf(path)
    config, tokenizer = config_and_tokenizer(path)
    model = build_on_codes(config, path, attn_implementation=attn_implementation, scan=scan)
    model.generation_config = GenerationConfig.from_model_config(config)
    model.config._name_or_path = str(path)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    gc.collect()  # the metadata parsed by the tokenizer and config loaders
    return model, tokenizer


def _meta_dir(path: Path) -> Path:
    """The cache folder of a GGUF file's config and tokenizer: the file (path, size, mtime) as
    transformers (its version) converts it."""
    import transformers

    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return cache_dir() / "gguf" / hashlib.sha1(raw.encode()).hexdigest()[:16]


def config_and_tokenizer(path: str | Path):
    """transformers' config and tokenizer of a GGUF file. Each of its two loaders parses the whole
    file's metadata (a 49k-token vocabulary and its merges: ~4-5 s each on a 2-core CPU), so both
    are saved to the cache (jacobi_ext/cache.py) the first time and read from there after
    (~0.3 s); a cache that cannot be written or read is parsed again."""
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    meta = _meta_dir(path)
    src, extra = str(path.parent), {"gguf_file": path.name}
    if (meta / "config.json").is_file() and (meta / "tokenizer_config.json").is_file():
        try:
            config = AutoConfig.from_pretrained(meta)
            tokenizer = AutoTokenizer.from_pretrained(meta)
            config._name_or_path = tokenizer.name_or_path = src  # as if parsed from the file
            return config, tokenizer
        except (OSError, ValueError):
            pass  # damaged: parse the file again (and leave the folder as it is)
    tokenizer = AutoTokenizer.from_pretrained(src, **extra)
    config = AutoConfig.from_pretrained(src, **extra)
    tmp = None
    try:  # written aside, then renamed: a reader never sees half a folder
        meta.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=meta.parent, prefix=".tmp-"))
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, meta)
    except OSError:  # read-only, or another process was first: nothing lost
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return config, tokenizer


def build_on_codes(config, path: str | Path, attn_implementation: str = "sdpa", scan=None):
    """The causal LM of `config` built on the meta device (no weight allocated) and pointed at
    the GGUF file's tensors by attach_gguf: no fp32 copy of a quantized weight is ever made."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation
        )
    attach_gguf(model, path, scan=scan)
    _materialise_buffers(model)
    stray = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if stray:
        raise RuntimeError(
            f"{Path(path).name}: the file has no tensor for {stray[:5]}"
            f"{' ...' if len(stray) > 5 else ''} (an architecture transformers maps differently?);"
            " load it dequantized instead: load_model(path, dequantize=True)"
        )
    return model.eval()


def _materialise_buffers(model) -> None:
    """Rebuild what the meta-device model computes at construction instead of loading (the
    rotary embedding's inverse frequencies), on the CPU."""
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)) and "Rotary" in type(mod).__name__:
            _set(model, name, type(mod)(config=model.config))


def attach_lora(model, adapter_dir: str | Path) -> None:
    """Put a peft LoRA adapter (adapter_config.json + adapter_model.safetensors) on the GGUF
    linears it targets, unmerged. Its factors stay bf16 where the adapter stores them so and the
    scale folds into B exactly (a power of two, as alpha / r usually is): the kernel widens them
    exactly to fp32, at half the bytes a step reads. Otherwise they are widened to fp32 here."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    if cfg.get("use_dora") or cfg.get("lora_bias") or cfg.get("modules_to_save"):
        raise ValueError(
            f"{adapter_dir}: DoRA, LoRA biases and modules_to_save are not supported unmerged on "
            "GGUF weights; load the model dequantized (dequantize=True) to merge it"
        )
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    if ranks or alphas:
        raise ValueError(f"{adapter_dir}: rank_pattern / alpha_pattern are not supported here")
    scale = alpha / (r**0.5) if cfg.get("use_rslora") else alpha / r
    state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, val in state.items():
        for part in ("lora_A", "lora_B"):
            tag = f".{part}."
            if tag in key:
                mod = key.split(tag)[0].removeprefix("base_model.model.")
                pairs.setdefault(mod, {})[part] = val
    factors: dict[GGUFLinear, tuple[torch.Tensor, torch.Tensor]] = {}  # fp32 A, B * scale
    for mod_path, ab in pairs.items():
        try:
            mod = model.get_submodule(mod_path)
        except AttributeError:
            mod = None
        if not isinstance(mod, GGUFLinear) or set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(
                f"{adapter_dir}: the adapter targets {mod_path}, which is not a GGUF linear of "
                "this model; load it dequantized (dequantize=True) to merge it"
            )
        factors[mod] = (ab["lora_A"].float(), ab["lora_B"].float() * scale)
    stored = {t.dtype for ab in pairs.values() for t in ab.values()}
    exact = all(torch.equal(b.bfloat16().float(), b) for _, b in factors.values())
    dtype = torch.bfloat16 if stored == {torch.bfloat16} and exact else torch.float32
    nr = _panel_width()
    for mod, (a, b) in factors.items():
        g = mod.group
        if g is None:
            mod.lora = _Lora.pack(a, b, None, dtype)
            continue
        if g.lora is not None:
            continue  # made with its first member
        # Linears side by side (q/k/v): one LoRA and one call; each member reads its panels of
        # B and the whole A (views: one copy of the factors).
        g.lora = _group_lora(g, factors, nr, dtype)
        p0 = 0
        for m in g.mods:
            panels = -(-m.out_features // nr)
            b_rows = g.lora.b.narrow(0, p0, panels)
            r0 = None if g.lora.panel_r0 is None else g.lora.panel_r0.narrow(0, p0, panels)
            nbytes = (b_rows.numel() + g.lora.a.numel() // len(g.mods)) * b_rows.element_size()
            m.lora = _Lora(g.lora.a, b_rows, g.lora.rank, m.out_features, nbytes, r0)
            p0 += panels
    if not factors:
        raise ValueError(f"{adapter_dir}: no LoRA weights found")
    gather_weights(model)  # the factors beside the codes they go with
    object.__setattr__(model, "lora_adapter", str(adapter_dir))
