"""The distillation subcommands of ``jacobi-forcing``: collect, train, distill, eval, gpu-run.

``REGISTRARS`` reaches ``jacobi_ext.apps.cli`` through the entry point ``training`` of the group
``jacobi_forcing.commands`` (pyproject.toml): jacobi_ext imports nothing from here. Heavy imports
(torch models, transformers, accelerate) happen inside the handlers so ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jacobi_ext.apps.cli_args import DEQUANTIZE_HELP, add_sampling_args, sampling_kwargs

_DTYPES = ["float32", "bfloat16", "float16"]


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _threads(args) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _add_runtime_args(p) -> None:
    """Where and how a command runs its model: --dtype, --device, --dequantize, --threads
    (collect, eval, fidelity)."""
    p.add_argument("--dtype", default="float32", choices=_DTYPES)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dequantize", action="store_true", help=DEQUANTIZE_HELP)
    p.add_argument("--threads", type=int, default=None)


def _cmd_collect(args: argparse.Namespace) -> int:
    from jacobi_ext.models import load_model

    from .prompts import load_prompts
    from .trajectories import collect

    _threads(args)
    end = args.start + args.limit if args.limit else None
    prompts = load_prompts(args.prompts)[args.start : end]
    model, tok = load_model(
        args.model, dtype=_dtype(args.dtype), device=args.device,
        dequantize=True if args.dequantize else None,
    )  # fmt: skip
    k, N = (int(x) for x in args.shard.split("/"))
    s = collect(
        model, tok, prompts, args.out, block_size=args.block_size,
        max_new_tokens=args.max_new_tokens, teacher=args.model or "base", shard=(k, N),
        max_prompt_tokens=args.max_prompt_tokens, fixed_points_only=args.fixed_points,
        batch_size=args.batch_size,
    )  # fmt: skip
    print(json.dumps(s))
    return 0


def _add_collect(sub) -> None:
    p = sub.add_parser(
        "collect",
        help="collect a teacher's Jacobi trajectories (resumable JSONL, see "
        "python_training/trajectories.py for the format)",
    )
    p.add_argument("--out", required=True, help="trajectory directory (created / resumed)")
    p.add_argument("--prompts", default=None, help="JSONL of prompts (default: stdlib prompts)")
    p.add_argument("--start", type=int, default=0, help="first prompt index")
    p.add_argument("--limit", type=int, default=None, help="number of prompts")
    p.add_argument("--block-size", type=int, default=16, help="n (default 16)")
    p.add_argument(
        "--max-new-tokens", type=int, default=64, help="cap, a multiple of n (default 64)"
    )
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="skip longer prompts")
    p.add_argument("--shard", default="0/1", help="k/N: this process's share of the prompts")
    p.add_argument(
        "--fixed-points",
        action="store_true",
        help="store only each block's fixed point, decoded with KV-cached greedy AR (fast): "
        "the data for synthetic noise (train --synthetic-fraction 1)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="prompts decoded together, left-padded, fixed points or Jacobi trajectories "
        "(default 1; for fixed points, 8 measured 3.8x the prompts/s of 1 in bf16 on 2 CPU "
        "cores: docs/results/collect-cpu-2026-11-24)",
    )
    p.add_argument("--model", default=None, help="teacher (default SmolLM2-135M-Instruct)")
    _add_runtime_args(p)
    p.set_defaults(handler=_cmd_collect)


def _cmd_prompts(args: argparse.Namespace) -> int:
    from .prompt_corpus import CORPUS, build_corpus, token_length_stats, write_corpus

    rows, manifest = build_corpus()
    if not args.no_token_stats:
        from jacobi_ext.models import load_model

        _, tok = load_model()
        manifest["prompt_tokens"] = token_length_stats(rows, tok)
    out = Path(args.out) if args.out else CORPUS
    write_corpus(rows, manifest, out)
    print(json.dumps({k: manifest[k] for k in ("total", "splits", "dropped")}))
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) and its manifest")
    return 0


def _add_prompts(sub) -> None:
    p = sub.add_parser(
        "prompts",
        help="rebuild the training-prompt corpus from this environment's installed code "
        "(python_training/prompt_corpus.py)",
    )
    p.add_argument("action", choices=["build"])
    p.add_argument(
        "--out", default=None, help="default: python_training/data/code_prompts.jsonl.gz"
    )
    p.add_argument(
        "--no-token-stats", action="store_true", help="skip the token lengths (no model load)"
    )
    p.set_defaults(handler=_cmd_prompts)


def _cmd_train(args: argparse.Namespace) -> int:
    from .trainer import TrainConfig, train

    d = {}
    if args.config:
        d.update(json.loads(Path(args.config).read_text()))
    for k in ("model", "out", "window", "schedule", "variant", "mask_window", "max_blocks",
              "max_seq_len", "ar_weight", "kl_weight", "temperature", "lr", "epochs", "max_steps",
              "grad_accum", "mixed_precision", "save_every", "seed", "threads",
              "consistency_reduction", "synthetic_fraction", "lookback",
              "max_noise_tokens", "lora_rank", "lora_alpha", "adapter_out", "init_adapter",
              "snapshot_every", "warmup_ratio", "stop_after_minutes"):  # fmt: skip
        v = getattr(args, k)
        if v is not None:
            d[k] = v
    if args.data:
        d["data"] = args.data
    if args.gradient_checkpointing:
        d["gradient_checkpointing"] = True
    if args.random_phase:
        d["random_phase"] = True
    if args.restart_schedule:
        d["restart_schedule"] = True
    if args.no_ar_prompt:
        d["ar_prompt"] = False
    if args.finished_only:
        d["finished_only"] = True
    last = train(TrainConfig.from_dict(d))
    print(json.dumps(last))
    return 0


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train AR + progressive consistency on trajectories (accelerate; resumes from the "
        "latest checkpoint in --out; run under `accelerate launch` for several processes)",
    )
    p.add_argument("--data", nargs="+", default=None, help="trajectory directories")
    p.add_argument("--out", default=None, help="run directory (default runs/train)")
    p.add_argument("--config", default=None, help="JSON of TrainConfig fields (flags override)")
    p.add_argument("--model", default=None, help="initial weights (default SmolLM2-135M)")
    p.add_argument("--window", type=int, default=None, help="noise window W (default 16)")
    p.add_argument("--schedule", default=None, choices=["linear", "random", "reverse"])
    p.add_argument(
        "--variant", default=None, choices=["noisy_context", "clean_context", "windowed"]
    )
    p.add_argument("--mask-window", type=int, default=None)
    p.add_argument("--max-blocks", type=int, default=None)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument(
        "--finished-only", action="store_true",
        help="train only on answers that reached EOS during collection (those cut at the "
        "collection cap are often the teacher looping)",
    )  # fmt: skip
    p.add_argument("--ar-weight", type=float, default=None, help="λ (default 10)")
    p.add_argument(
        "--no-ar-prompt", action="store_true",
        help="AR loss on the answer only, not on the prompt's own tokens (docs/method.md §3 "
        "includes them): anchors the student to the teacher's answers without fine-tuning it "
        "on prompts",
    )  # fmt: skip
    p.add_argument(
        "--kl-weight", type=float, default=None,
        help="μ of a KL to the frozen base model (the LoRA adapter switched off) at the AR "
        "positions, which keeps the base's distribution where the AR term keeps only its greedy "
        "token (default 0; LoRA only)",
    )  # fmt: skip
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument(
        "--consistency-reduction", default=None, choices=["mean_div_T", "mean"],
        help="mean_div_T (docs/method.md §3, default): mean over kept positions / T; "
        "mean: plain mean",
    )  # fmt: skip
    p.add_argument(
        "--synthetic-fraction", type=float, default=None,
        help="fraction of blocks whose noisy state is drawn fresh at every packing "
        "(progressive masking with context tokens) instead of taken from the trajectories",
    )  # fmt: skip
    p.add_argument("--lookback", type=int, default=None, help="synthetic noise window (128)")
    p.add_argument(
        "--max-noise-tokens", type=int, default=None,
        help="tokens replaced at noise level 1 (default n; n-1 keeps the first, as a "
        "Jacobi draft's seed always is)",
    )  # fmt: skip
    p.add_argument(
        "--random-phase", action="store_true",
        help="draw the saw-tooth's phase per packing (short answers meet every noise level)",
    )  # fmt: skip
    p.add_argument("--lr", type=float, default=None, help="default 1e-5")
    p.add_argument("--epochs", type=float, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--warmup-ratio", type=float, default=None, help="default 0.03")
    p.add_argument(
        "--stop-after-minutes", type=float, default=None,
        help="end this call after so many minutes, at a step, with a checkpoint (and the "
        "adapter) saved: a long run goes in chunks; the same command goes on",
    )  # fmt: skip
    p.add_argument("--grad-accum", type=int, default=None)
    p.add_argument("--mixed-precision", default=None, choices=["no", "bf16", "fp16"])
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--save-every", type=int, default=None, help="optimizer steps per checkpoint")
    p.add_argument(
        "--snapshot-every", type=int, default=None,
        help="optimizer steps between kept snapshots (a LoRA run's are adapters): the points "
        "of a held-out curve",
    )  # fmt: skip
    p.add_argument(
        "--lora-rank", type=int, default=None,
        help="train a LoRA adapter of this rank (peft) instead of the full weights (default 0: "
        "full); its adapter + train_state.json are written at every save",
    )  # fmt: skip
    p.add_argument("--lora-alpha", type=float, default=None, help="default 2 x rank")
    p.add_argument("--adapter-out", default=None, help="where the adapter goes (out/adapter)")
    p.add_argument(
        "--init-adapter", default=None,
        help="go on from this adapter and its train_state.json (e.g. the one committed by an "
        "earlier run on another machine) when --out has no checkpoint",
    )  # fmt: skip
    p.add_argument(
        "--restart-schedule", action="store_true",
        help="with --init-adapter: keep its weights and token count but start the data position "
        "and the LR schedule (warm-up, cosine to 0) afresh, e.g. a new chunk on new prompts",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(handler=_cmd_train)


def _cmd_distill(args: argparse.Namespace) -> int:
    from .distill import load_recipe, run_recipe

    recipe = load_recipe(args.recipe)
    final = run_recipe(recipe, out=args.out)
    print(f"final model: {final}")
    return 0


def _add_distill(sub) -> None:
    p = sub.add_parser(
        "distill",
        help="run a curriculum recipe: collect -> train per stage, regenerating trajectories "
        "with each stage's model (resumable; finished stages are skipped)",
    )
    p.add_argument("--recipe", required=True, help="TOML recipe (python_training/recipes/)")
    p.add_argument("--out", default=None, help="override the recipe's output directory")
    p.set_defaults(handler=_cmd_distill)


def _sampling(args: argparse.Namespace) -> dict | None:
    """eval's sampling options (a fixed seed, 0 unless given: rows must be reproducible)."""
    if not args.do_sample:
        return None
    kw = sampling_kwargs(args)
    kw["seed"] = kw["seed"] if kw["seed"] is not None else 0
    return kw


def _check_prompts(command: str, prompts: str, checker: str | None = None) -> bool:
    """Whether ``--prompts`` (a prompt set, or a JSONL file read and checked here, before any
    model loads) is usable; if not, the reason is printed as the command's error."""
    import sys

    from .evaluate import PROMPT_SETS, _is_prompt_file, read_prompt_file

    try:
        if prompts in PROMPT_SETS:
            if checker == "answer" or (prompts == "code-heldout" and checker == "tests"):
                raise ValueError(f"{prompts} has no answers to check with --checker {checker}")
        elif _is_prompt_file(prompts):
            read_prompt_file(prompts, checker)
        else:
            raise ValueError(
                f"--prompts {prompts!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) nor a "
                "JSONL file"
            )
    except (ValueError, FileNotFoundError, UnicodeDecodeError, OSError) as e:
        print(f"jacobi-forcing {command}: error: {e}", file=sys.stderr)
        return False
    return True


def _cmd_eval(args: argparse.Namespace) -> int:
    from jacobi_ext.models import load_model

    from .evaluate import evaluate, format_summary

    checker = None if args.checker == "auto" else args.checker
    if not _check_prompts("eval", args.prompts, checker):
        return 2
    _threads(args)
    model, tok = load_model(
        args.model, dtype=_dtype(args.dtype), device=args.device,
        dequantize=True if args.dequantize else None,
    )  # fmt: skip
    s = evaluate(
        model, tok, args.results, methods=args.methods, limit=args.limit, offset=args.offset,
        max_new_tokens=args.max_new_tokens, block_size=args.block_size,
        num_blocks=args.num_blocks, pool_size=args.pool_size, timeout=args.timeout,
        label=args.label or str(args.model or "base"), prompts=args.prompts,
        sampling=_sampling(args), checker=checker,
    )  # fmt: skip
    print(format_summary(s))
    return 0


_EVAL_DEFAULT = ["greedy", "jacobi", "multiblock"]


_PROMPTS_HELP = (
    "humaneval (default), code-heldout (the held-out package split of the shipped prompt "
    "corpus: no tests, no pass@1) or a JSONL file of your own prompts, one JSON object a line: "
    "prompt (or messages, a chat), optional id, optional answer / tests "
    "(docs/eval_your_prompts.md)"
)


def _add_eval(sub) -> None:
    from .checkers import CHECKERS
    from .evaluate import METHODS

    p = sub.add_parser(
        "eval",
        help="HumanEval, the held-out prompt split or your own JSONL prompts: TPF, tokens/s, "
        "speedup over transformers greedy, accuracy (pass@1 or answer match; resumable)",
    )
    p.add_argument("--results", required=True, help="JSONL results file (appended / resumed)")
    p.add_argument("--model", default=None, help="checkpoint (default SmolLM2-135M-Instruct)")
    p.add_argument(
        "--methods", nargs="+", default=_EVAL_DEFAULT, choices=METHODS,
        help="default: greedy jacobi multiblock (-tuned: block size chosen by the tuner; "
        "multiblock-nolookup: without the context-lookup row; ar-lookup: AR with lookup drafts)",
    )  # fmt: skip
    p.add_argument("--prompts", default="humaneval", metavar="SET_OR_FILE", help=_PROMPTS_HELP)
    p.add_argument(
        "--checker", default="auto", choices=["auto", *CHECKERS],
        help="how a prompt file's outputs are checked: auto (default: each line by its fields, "
        "tests -> pass@1 of the Python tests, answer -> exact match of the final answer), or "
        "one checker for every line (none: TPF and speed only, also skips HumanEval's tests)",
    )  # fmt: skip
    p.add_argument("--limit", type=int, default=None, help="problems (default all)")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2)
    p.add_argument("--pool-size", type=int, default=4)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per test run")
    p.add_argument("--label", default=None)
    _add_runtime_args(p)
    add_sampling_args(p)
    p.set_defaults(handler=_cmd_eval)


def _cmd_fidelity(args: argparse.Namespace) -> int:
    from jacobi_ext.models import load_model

    from .fidelity import fidelity, reference_rows

    if not _check_prompts("fidelity", args.prompts):
        return 2
    _threads(args)
    rows = reference_rows(args.reference, args.method)
    rows = rows[args.offset :][: args.limit]  # limit None: all
    model, tok = load_model(
        args.model, dtype=_dtype(args.dtype), device=args.device,
        dequantize=True if args.dequantize else None,
    )  # fmt: skip
    out = fidelity(model, tok, rows, prompts=args.prompts)
    out["model"], out["reference"] = str(args.model or "base"), str(args.reference)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    s = out["summary"]
    print(
        f"{out['model']}: {s['tasks']} tasks, {s['tokens']} base-answer tokens: top-1 agreement "
        f"{s['agreement']:.3f}, NLL {s['nll']:.3f}, median shared greedy prefix "
        f"{s['median_prefix']} tokens, identical answers {100 * s['identical']:.1f} %"
    )
    return 0


def _add_fidelity(sub) -> None:
    p = sub.add_parser(
        "fidelity",
        help="how close a (distilled) model stays to the base: the base's greedy answers "
        "teacher-forced, top-1 agreement, NLL, shared greedy prefix (one forward per task)",
    )
    p.add_argument(
        "--reference", required=True,
        help="eval results JSONL holding the base model's greedy rows (token_ids)",
    )  # fmt: skip
    p.add_argument("--method", default="greedy", help="which rows of --reference (default greedy)")
    p.add_argument("--model", default=None, help="checkpoint or adapter (default the base)")
    p.add_argument(
        "--prompts", default="humaneval", metavar="SET_OR_FILE",
        help="the prompt set or JSONL file --reference was decoded on: " + _PROMPTS_HELP,
    )  # fmt: skip
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON with the summary and every task's scores")
    _add_runtime_args(p)
    p.set_defaults(handler=_cmd_fidelity)


def _cmd_distill_report(args: argparse.Namespace) -> int:
    from .distill_report import report

    _threads(args)
    files = report(
        args.run, args.out, limit=args.limit, max_new_tokens=args.max_new_tokens,
        block_size=args.block_size, scaling=not args.no_scaling, base=args.base,
    )  # fmt: skip
    for f in files:
        print(f"wrote {f}")
    return 0


def _add_distill_report(sub) -> None:
    p = sub.add_parser(
        "distill-report",
        help="training curves of a distill run, and held-out TPF vs trajectories seen "
        "(a scaling curve over the run's snapshots; resumable)",
    )
    p.add_argument("--run", required=True, help="the distill output directory")
    p.add_argument("--out", required=True, help="where the PNGs and scaling.jsonl go")
    p.add_argument("--base", default=None, help="the run's base model (default SmolLM2)")
    p.add_argument("--limit", type=int, default=12, help="held-out HumanEval problems")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16, help="Jacobi n for the TPF")
    p.add_argument("--no-scaling", action="store_true", help="only the training curves")
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(handler=_cmd_distill_report)


def _add_gpu_run(sub) -> None:
    from .jobs.gpu_run import add_parser  # light: its heavy imports happen inside the handler

    add_parser(sub)


REGISTRARS = [_add_prompts, _add_collect, _add_train, _add_distill, _add_eval, _add_fidelity,
              _add_distill_report, _add_gpu_run]  # fmt: skip
