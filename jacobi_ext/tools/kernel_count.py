"""How many device kernels one decoding step of the CUDA path launches, counted on a CPU.

Why count: a small model's GPU step is bound by kernel launches, not bytes. SmolLM2-135M reads
its ~270 MB of bf16 weights in ~0.07 ms on an H200, while its CUDA step, transformers' Llama
forward inside one CUDA graph, took 4.49 ms: ~1 800 kernels at ~2.5 us each. The kernel count
is the number to hold down, and it needs no GPU to know.

How: the step runs as the engine runs it on a GPU, on the "meta" device. The runtime
(runtime.StaticRuntime) and the step (step.BatchStep._step, what a CUDA graph captures: the
inputs' gathers, the mask, the forward, the targets, acceptance, the verify op, the K/V commit,
the next drafts) take their non-CPU branches for any device other than "cpu", so meta runs
the CUDA code paths with shapes only (no data, no time). The forward is the one the runtime
picks itself (`_logits` asks `lean.lean_decoder`, and whatever else it asks): a fused forward
that applies to a non-CPU model is counted as soon as the runtime picks it, without a change
here. The fused CUDA decode ops (lean.CudaLeanDecoder, the one-launch K/V commit, the argmax)
are chosen by one predicate, prepack.cuda_decode_on(device), which `meta_as_cuda()` makes true
for meta while counting: the count is that of a CUDA build, whatever this build has, their fake
kernels running on meta. (Fake "cuda" tensors would need a CUDA build of torch to be indexed
from Python, which a CPU machine lacks.) A TorchDispatchMode sees every op the step dispatches
and counts the ones that launch a kernel:

- counted: every aten op that computes or writes device memory (arithmetic, reductions,
  copies and casts (`_to_copy`, `copy_`, `clone`), fills (`zeros` is an allocation + a
  `fill_`), indexing writes (`index_copy_`, `index_put_`), GEMMs (`mm`, `addmm`, `bmm`),
  argmax, ...), each as one kernel;
- counted as one kernel each: every `torch.ops.jacobi_ext.*` custom op (`KERNELS_PER_OP` names
  any that launches more; its fake kernel is what runs on meta);
- not counted: views and metadata (`view`, `transpose`, `slice`, `expand`, `unsqueeze`,
  `select`, `as_strided`, `alias`, `detach`, `_unsafe_view`; the ops torch marks as views), and
  allocations without a fill (`empty`, `empty_strided`): no kernel runs for them.
- Composite ops (`linear`, `contiguous`, `reshape`, `to`, ...) are decomposed first, as torch
  itself does below autograd, and counted by what they become (`linear` = `t` (a view) + `mm`;
  `contiguous` of a contiguous tensor = nothing).

What it is not: cuBLAS may split a GEMM into two kernels, an argmax may take two; a graph replay
adds no launch of its own. transformers' SDPA call is counted by its math decomposition (on meta
it has no fused backend: two `bmm`, a softmax, the mask's `where` and casts, ~7 where a GPU's
flash or memory-efficient backend launches one to three); the counts of issue 63 were made so.
The count is the ops a graph holds: the quantity the fused decode step brings down (the budget:
`within_budget`, at most 10 a layer and 330 a step). Per layer is measured, not assumed: the
step is counted for the model with its layers and with one layer, and the difference divided.
"""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The budget of the fused CUDA decode step (issue 63): per layer add + RMSNorm, one QKV GEMM,
# RoPE + K/V write + attention, o GEMM + residual, add + RMSNorm, gate/up GEMM + SiLU*up,
# down GEMM + residual (7, with room for 3); per step also the embedding, the final norm, the
# LM head with argmax, the verify op and the commit.
BUDGET_PER_LAYER = 10
BUDGET_PER_STEP = 330

# aten ops that launch no kernel and are not marked as views by torch: allocations, metadata.
NO_KERNEL = frozenset(
    {
        "empty",
        "empty_strided",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "alias",
        "detach",
        "lift_fresh",
        "_unsafe_view",
        "_reshape_alias",
        "resize_",
        "set_",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "_has_compatible_shallow_copy_type",
        "is_contiguous",
    }
)
# Custom ops that launch more than one kernel (name -> kernels); the rest count one each.
KERNELS_PER_OP: dict[str, int] = {  # by op name, without the namespace
    # rotary + K/V write + the attention's key splits, then the splits' combine (decode_cuda.cu)
    "rope_attention": 2,
}


def kernels_of(func) -> int:
    """The kernels one call of the dispatched op `func` (an OpOverload) launches, by the rule of
    the module docstring."""
    ns = func.namespace
    name = func.__name__.split(".")[0]
    if ns == "jacobi_ext":
        return KERNELS_PER_OP.get(name, 1)
    if ns != "aten" or func.is_view or name in NO_KERNEL:
        return 0
    return 1


class KernelCounter(TorchDispatchMode):
    """Counts the kernels of the ops dispatched while it is active (see the module docstring).
    `ops`: kernels per op name; `total`: their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A composite op (linear, contiguous, to, reshape, ...) is counted by what it becomes:
        # decompose() dispatches its parts, which come back through this mode.
        if torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), torch._C.DispatchKey.CompositeImplicitAutograd
        ):
            with self:  # (inside its handler the mode is off: on again for the parts)
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        k = kernels_of(func)
        if k:
            self.ops[f"{func.namespace}.{func.__name__.split('.')[0]}"] += k
        return func(*args, **kwargs)


def count(fn, *args, **kwargs) -> tuple[KernelCounter, object]:
    """Run fn(*args, **kwargs) under a KernelCounter: (the counter, fn's result)."""
    with KernelCounter() as c:
        out = fn(*args, **kwargs)
    return c, out


def smollm2_135m_config():
    """SmolLM2-135M's architecture (the shipped model's): 30 Llama layers, hidden 576, 9 query
    and 3 K/V heads of 64, MLP 1536, vocabulary 49152, tied LM head. No file is read."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=None,
    )  # fmt: skip


def qwen25_7b_config():
    """Qwen2.5-7B's architecture: 28 layers, hidden 3584, 28 query and 4 K/V heads of 128, MLP
    18944, vocabulary 152064, untied LM head (the GPU bench's 7B-shaped row)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rope_theta=1e6, tie_word_embeddings=False, eos_token_id=151643,
    )  # fmt: skip


def qwen3_06b_config():
    """Qwen3-0.6B's architecture: 28 layers, hidden 1024, 16 query and 8 K/V heads of 128 with
    per-head q/k RMSNorms, MLP 3072, vocabulary 151936, tied LM head."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=True,
        eos_token_id=151645,
    )  # fmt: skip


# Architectures by name, for `jacobi-forcing tune --kernels --model NAME` (nothing is loaded).
SHAPES = {
    "smollm2-135m": smollm2_135m_config,
    "qwen2.5-7b": qwen25_7b_config,
    "qwen3-0.6b": qwen3_06b_config,
}


def config_for(name: str | None):
    """The architecture to count for --model `name`: a SHAPES name; the default model or a
    shipped adapter (SmolLM2-135M's); a checkpoint folder or hub id in the local cache (its
    config.json); a .gguf file (its metadata). No weights are read."""
    from pathlib import Path

    from ..models import ADAPTERS, DEFAULT_MODEL

    if name is None or name in ADAPTERS or name == DEFAULT_MODEL:
        return smollm2_135m_config()
    if name in SHAPES:
        return SHAPES[name]()
    if Path(name).suffix == ".gguf":
        from ..models.quantized import config_and_tokenizer

        return config_and_tokenizer(Path(name))[0]
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name, local_files_only=True)


def meta_model(config, dtype: torch.dtype = torch.bfloat16, layers: int | None = None):
    """A model of `config`'s architecture on the meta device (shapes, no weights: built in well
    under a second whatever its size). `layers` replaces the layer count."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)  # _from_config writes into the config
    if layers is not None:
        cfg.num_hidden_layers = layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


@dataclass
class StepCount:
    """The kernels of one decoding step (see the module docstring)."""

    method: str  # "ar", "jacobi" or "prefill" (a middle chunk of a chunked prefill)
    width: int  # tokens the step feeds (its graph's bucket)
    layers: int
    total: int  # kernels of the whole step
    per_layer: float  # kernels a decoder layer adds
    forward: str  # which forward the runtime picked: "transformers" or the fused one's class
    ops: dict[str, int] = field(default_factory=dict)  # kernels per op name, whole step

    @property
    def outside_layers(self) -> float:
        return self.total - self.per_layer * self.layers


def _one_step(model, method: str, n: int, context: int) -> tuple[KernelCounter, str]:
    """The kernels of one step of `method` (n: the Jacobi block) on a meta model, counted on its
    second run (the first one initialises the cache's buffers, as a graph's warm-up does)."""
    from ..decoding.prepack import meta_as_cuda
    from ..decoding.runtime import StaticRuntime, bucket
    from ..decoding.step import BatchStep

    if method == "prefill":
        return _one_chunk(model, n, context)
    eos = {int(model.config.eos_token_id or 0)}
    if method == "ar":
        block, scratch, Q = 1, 1, 1
    elif method == "jacobi":  # one block, no pool (engine: K, p = 1, 0), fed in one bucket
        block, scratch, Q = n, bucket(2 * n), bucket(n)
    else:
        raise ValueError(f"method must be 'ar', 'jacobi' or 'prefill', got {method!r}")
    with torch.inference_mode(), meta_as_cuda():  # meta stands for a GPU with a CUDA build
        rt = StaticRuntime(model, 1, context + 256 + scratch, scratch, cuda_graphs=False)
        bs = BatchStep(rt, block, 1, 0, 0.85, eos)
        bs.reset([[0] * context])
        attend = rt.capacity  # a graph attends every slot
        mix = (method == "ar", method != "ar")  # every sequence AR, or every one parallel
        for _ in range(2):  # the first picks the forward, the second builds what it caches once
            bs._step(Q, attend, mix)
        c, _ = count(bs._step, Q, attend, mix)
    lean = rt._lean
    return c, (type(lean).__name__ if lean else "transformers")


def _one_chunk(model, chunk: int, context: int) -> tuple[KernelCounter, str]:
    """The kernels of one middle chunk of a chunked prefill (runtime._prefill_chunked: a step of
    `chunk` prompt tokens in one row, no LM head, then its commit) after `context` tokens."""
    from ..decoding.prepack import meta_as_cuda
    from ..decoding.runtime import StaticRuntime

    with torch.inference_mode(), meta_as_cuda():
        rt = StaticRuntime(model, 1, context + 2 * chunk, chunk, cuda_graphs=False)
        rt.seg[:, :chunk] = 0
        rt.off[:, :chunk] = torch.arange(chunk, device=rt.device)

        def middle():
            rt.forward(chunk, rt.capacity, keep=0)
            rt.commit(rt._pf_src, rt._pf_count)

        rt._pick_forward()  # as a prefill picks it, before its chunks
        for _ in range(2):
            middle()
        c, _ = count(middle)
    lean = rt._lean
    return c, (type(lean).__name__ if lean else "transformers")


def count_step(
    config=None, method: str = "ar", n: int = 64, dtype: torch.dtype = torch.bfloat16,
    context: int = 256,
) -> StepCount:  # fmt: skip
    """The kernels of one decoding step of the CUDA path for a model of `config` (default:
    SmolLM2-135M's), `method` "ar", "jacobi" (block of n) or "prefill" (a middle chunk of n
    prompt tokens), the K/V cache holding `context` tokens. Per layer: the step with every
    layer minus the step with one, over the difference."""
    config = config or smollm2_135m_config()
    L = config.num_hidden_layers
    full, forward = _one_step(meta_model(config, dtype), method, n, context)
    width = 1 if method == "ar" else n
    if L > 1:
        one, _ = _one_step(meta_model(config, dtype, layers=1), method, n, context)
        per_layer = (full.total - one.total) / (L - 1)
    else:
        per_layer = float(full.total)
    return StepCount(method, width, L, full.total, per_layer, forward, dict(full.ops))


def within_budget(c: StepCount, per_layer: int = BUDGET_PER_LAYER,
                  per_step: int = BUDGET_PER_STEP) -> bool:  # fmt: skip
    """Whether a step meets the fused decode step's budget (issue 63: at most 10 kernels a layer
    and 330 a step, for ar and for Jacobi at n = 64)."""
    return c.per_layer <= per_layer and c.total <= per_step


def check_budget(c: StepCount, per_layer: int = BUDGET_PER_LAYER,
                 per_step: int = BUDGET_PER_STEP) -> None:  # fmt: skip
    """Raises AssertionError, naming the count and its most launched ops, unless `c` is within
    the budget: the assertion a fused decode step's test makes."""
    if not within_budget(c, per_layer, per_step):
        ops = sorted(c.ops.items(), key=lambda kv: -kv[1])[:8]
        raise AssertionError(
            f"{c.method} step (width {c.width}, forward {c.forward}): {c.total} kernels, "
            f"{c.per_layer:.1f} a layer; budget {per_step} a step, {per_layer} a layer. Most "
            "launched: " + ", ".join(f"{k} {v}" for k, v in ops)
        )


def _name(c: StepCount) -> str:
    return {"ar": "ar", "jacobi": f"jacobi n={c.width}"}.get(c.method, f"prefill {c.width}")


def report(counts: list[StepCount], top: int = 12) -> str:
    """The counts as the command prints them."""
    lines = [
        f"{'step':<14} {'kernels/step':>12} {'per layer':>10} {'outside':>8}  forward  budget "
        f"(<= {BUDGET_PER_LAYER}/layer, <= {BUDGET_PER_STEP}/step)"
    ]
    for c in counts:
        name = _name(c)
        ok = "within" if within_budget(c) else "over"
        lines.append(
            f"{name:<14} {c.total:>12} {c.per_layer:>10.1f} {c.outside_layers:>8.0f}  "
            f"{c.forward}  {ok}"
        )
    for c in counts:
        name = _name(c)
        ops = sorted(c.ops.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
        lines.append(f"{name}, most launched: " + ", ".join(f"{k} {v}" for k, v in ops))
    return "\n".join(lines)
