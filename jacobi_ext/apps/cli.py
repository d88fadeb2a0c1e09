"""The `jacobi-forcing` command line.

Each subcommand lives next to the code it drives: jacobi_ext's own are registered here, other
packages add theirs through the entry-point group ``jacobi_forcing.commands`` (python_training's
distillation commands). Heavy imports (torch models, transformers) happen inside the handlers so
`jacobi-forcing --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from jacobi_ext.apps.cli_args import add_model_args, add_sampling_args, sampling_kwargs
from jacobi_ext.models import DTYPE_NAMES

Handler = Callable[[argparse.Namespace], int]


def _cmd_info(args: argparse.Namespace) -> int:
    import jacobi_ext

    info = jacobi_ext.build_info()
    if args.json:
        if args.modes:
            info["modes"] = _modes(args).as_dict()
        print(json.dumps(info, indent=2))
        return 0
    # First the kernels this build has, then every fact.
    if info["cuda kernels"]:
        cuda = f"CUDA for {info['cuda archs']}"
    else:
        why = info["no cuda kernels because"]
        cuda = "no CUDA kernels" + (f" ({why})" if why else "")
    print(f"kernels built: CPU (this CPU runs the {info['cpu kernel isa']} variant); {cuda}")
    width = max(len(k) for k in info)
    for k, v in info.items():
        print(f"{k:<{width}}  {v}")
    if args.modes:
        print(f"faster mode here ({args.model or 'the default model'}): {_modes(args).advice()}")
    else:
        print("(jacobi-forcing info --modes measures which CPU mode decodes faster here)")
    return 0


def _modes(args: argparse.Namespace):
    """The exact and 8-bit modes' one-token forwards on the model asked for, side by side."""
    from rich.console import Console

    from jacobi_ext.models import load_model
    from jacobi_ext.tools.modes import compare_modes

    with Console(stderr=True).status("loading the model and timing both modes"):
        model, _ = load_model(args.model)
        return compare_modes(model)


def _add_info(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="show how jacobi_ext was built and what it runs on")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.add_argument(
        "--modes",
        action="store_true",
        help="also time a one-token forward exact and on 8-bit activations (--int8-activations) "
        "and say which is faster on this machine (loads the model, a few seconds)",
    )
    p.add_argument("--model", default=None, help="the model --modes times (default: SmolLM2)")
    p.set_defaults(handler=_cmd_info)


def _load(args: argparse.Namespace):
    from jacobi_ext.models import load_from_args

    return load_from_args(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from jacobi_ext.apps.demo import ForwardColourStreamer
    from jacobi_ext.data import chat_input_ids
    from jacobi_ext.decoding import generate

    console = Console()
    with console.status("loading model"):
        model, tok = _load(args)
    ids = (
        chat_input_ids(tok, args.prompt)
        if not args.raw
        else tok(args.prompt, return_tensors="pt").input_ids
    )
    streamer = ForwardColourStreamer(tok, console)
    res = generate(
        model,
        ids.to(args.device),
        max_new_tokens=args.max_new_tokens,
        method=args.method,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        pool_size=args.pool_size,
        activation_ratio=args.activation_ratio,
        streamer=streamer,
        lookup=args.lookup,
        stop_strings=args.stop or None,
        max_time=args.max_time,
        tokenizer=tok,
        **sampling_kwargs(args),
    )
    console.print()
    if res.sampling is not None:
        c = res.sampling
        console.print(
            f"[dim]sampled: temperature {c.temperature}, top_k {c.top_k}, top_p {c.top_p}, "
            f"min_p {c.min_p}, seed {res.seed} (the same tokens as --method ar with this seed)[/]"
        )
    console.print(
        f"[bold]{res.method}[/] n={res.block_size} K={res.num_blocks} pool={res.pool_size}: "
        f"{res.new_tokens} tokens in {res.forwards} forwards "
        f"(TPF {res.tokens_per_forward:.2f}), {res.tokens_per_second:.1f} tokens/s"
        + (
            f", {res.candidate_wins} candidate wins ({res.lookup_wins} by lookup)"
            if res.candidate_wins
            else ""
        )
    )
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode one prompt and print the text and the stats")
    p.add_argument("--prompt", required=True, help="the user message (chat template applied)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--method", default="multiblock", choices=["ar", "jacobi", "multiblock"])
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None, help="default: tuned")
    p.add_argument("--num-blocks", type=int, default=2)
    p.add_argument("--pool-size", type=int, default=4)
    p.add_argument("--activation-ratio", type=float, default=0.85)
    p.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="end the answer once it holds TEXT (repeatable; kept, as transformers' stop_strings)",
    )
    p.add_argument(
        "--max-time", type=float, default=None, metavar="S", help="end the answer after S seconds"
    )
    p.add_argument(
        "--lookup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="verify context-lookup drafts too (default: on for multiblock and tuned settings)",
    )
    add_sampling_args(p)
    add_model_args(p)
    p.set_defaults(handler=_cmd_generate)


def _cmd_kernels(args: argparse.Namespace) -> int:
    """tune --kernels: the CUDA step's kernels, counted on this CPU (tools/kernel_count.py)."""
    import torch

    from jacobi_ext.decoding.runtime import PREFILL_CHUNK
    from jacobi_ext.models import DTYPE_NAMES
    from jacobi_ext.tools import kernel_count

    dtype = DTYPE_NAMES[args.dtype or "bfloat16"]
    config = kernel_count.config_for(args.model)
    counts = [kernel_count.count_step(config, "ar", dtype=dtype)]
    counts += [kernel_count.count_step(config, "jacobi", n=w, dtype=dtype) for w in args.width]
    chunk = PREFILL_CHUNK  # a prompt runs as chunks of this many tokens on CUDA
    counts.append(kernel_count.count_step(config, "prefill", n=chunk, dtype=dtype))
    arch = config.architectures[0] if getattr(config, "architectures", None) else ""
    print(
        f"kernels per decode step on the CUDA path: {args.model or 'SmolLM2-135M'} "
        f"({arch or type(config).__name__}, {config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}), {str(dtype).removeprefix('torch.')}, batch 1, a cache of 256; "
        f"counted on meta tensors (torch {torch.__version__})"
    )
    print(kernel_count.report(counts))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from jacobi_ext.decoding import tuning
    from jacobi_ext.tools import roofline

    if args.kernels:
        return _cmd_kernels(args)
    args.dtype = args.dtype or "float32"
    console = Console()
    with console.status("loading model"):
        model, _ = _load(args)
    curve = tuning.step_curve(model, remeasure=args.remeasure, progress=True, full=True)
    prof = tuning.load_profile(model)
    rho = args.rho if args.rho is not None else prof.get("rho", tuning.PRIOR_RHO)
    # The roofline: what this machine allows each width to cost.
    with console.status("measuring read bandwidth and compute peak"):
        machine, cost = roofline.model_machine(model)
    console.print(machine.describe())
    console.print(
        f"model: {cost.weight_bytes / 1e6:.1f} MB of weights read per forward, "
        f"{2 * cost.linear_params / 1e6:.0f} MFLOP per token in its linears; "
        "floor t_min(q) = max(bytes / bandwidth, FLOPs(q) / peak), with the bandwidth of reading "
        "as many bytes over and over"
    )
    t = Table(
        title=f"forward time vs new tokens ({curve.hardware}, {curve.dtype}, "
        f"{curve.threads} threads, cache {curve.context})"
    )
    t.add_column("tokens", justify="right")
    t.add_column("ms", justify="right")
    t.add_column("x one token", justify="right")
    t.add_column("floor ms", justify="right")
    t.add_column("x floor", justify="right")
    rows = roofline.roofline_rows(curve, machine, cost, sizes=curve.sizes)
    for (q, _, floor_ms, ratio), s in zip(rows, curve.seconds, strict=True):
        t.add_row(
            str(q),
            f"{1e3 * s:.1f}",
            f"{s / curve.seconds[0]:.2f}",
            f"{floor_ms:.1f}",
            f"{ratio:.2f}",
        )
    console.print(t)
    console.print(f"knee (within 25% of one token): {curve.knee()} tokens")
    src = (
        "given"
        if args.rho is not None
        else ("observed" if "rho" in prof else "prior, no run observed yet")
    )
    console.print(f"acceptance rate rho = {rho:.3f} ({src})")
    for method in ("jacobi", "multiblock"):
        s = tuning.choose_settings(
            model, method, args.num_blocks, args.pool_size, rho=rho, curve=curve
        )
        console.print(
            f"{method:>10}: -> {s.method} n={s.block_size} K={s.num_blocks} pool={s.pool_size}"
            f", predicted {s.expected_speedup:.2f}x greedy"
        )
    modes = prof.get("modes", {})
    if modes:  # the race of tuned calls with lookup drafts (tuning.choose_settings)
        raced = ", ".join(
            f"{m} {v['speedup']:.2f}x over {v['weight']:.0f} tokens" for m, v in modes.items()
        )
        s = tuning.choose_settings(
            model, "multiblock", args.num_blocks, args.pool_size, curve=curve, lookup=True
        )
        console.print(
            f"measured by tuned calls with lookup: {raced}; the next one runs "
            f"{'AR with lookup' if s.method == 'ar' else f'{s.method} n={s.block_size}'} "
            f"({prof.get('tuned_calls', 0)} calls so far)"
        )
    if args.plot:
        from jacobi_ext.apps.plots import plot_step_curve

        floor = roofline.floor_curve(machine, cost, curve)
        path = plot_step_curve(curve, args.plot, floor=floor)
        console.print(f"curve written to {path}")
    return 0


def _add_tune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="measure this machine's forward-time curve and show the settings the tuner picks",
    )
    p.add_argument("--remeasure", action="store_true", help="ignore the cached curve")
    p.add_argument(
        "--rho",
        type=float,
        default=None,
        help="acceptance rate to plan for (default: what this model showed)",
    )
    p.add_argument("--num-blocks", type=int, default=2)
    p.add_argument("--pool-size", type=int, default=4)
    p.add_argument("--plot", default=None, metavar="PNG", help="also write the curve as a PNG")
    p.add_argument(
        "--kernels",
        action="store_true",
        help="instead: print the device kernels per decode step of the CUDA path (ar and Jacobi "
        "at each --width), per layer and per step, counted on this CPU with meta tensors; "
        "nothing is loaded (--model: a checkpoint's config, or smollm2-135m / qwen2.5-7b); "
        "bf16 unless --dtype says otherwise",
    )
    p.add_argument(
        "--width",
        type=int,
        nargs="+",
        default=[64],
        help="with --kernels: Jacobi block sizes to count (default 64)",
    )
    add_model_args(p)
    p.set_defaults(handler=_cmd_tune, dtype=None)  # None: float32 to measure, bf16 to count


def _cmd_demo(args: argparse.Namespace) -> int:
    from jacobi_ext.apps.demo import run_demo

    return run_demo(args)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="decode HumanEval prompts: the base model's greedy, then the distilled model "
        "(smollm2-jf) by greedy, jacobi and multiblock; show the tokens each forward accepted "
        "and the speedups",
    )
    p.add_argument("--prompts", type=int, default=3, help="HumanEval prompts (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default="jacobi_demo", help="folder for the curve PNG and JSON")
    p.add_argument("--quiet", action="store_true", help="no live text, just the table")
    p.add_argument(
        "--base", action="store_true",
        help="the base model alone, even when a distilled model exists (the shipped "
        "smollm2-jf adapter, else the newest ./runs/*/final, which the demo otherwise shows)",
    )  # fmt: skip
    add_sampling_args(p)
    add_model_args(p)
    p.set_defaults(handler=_cmd_demo)


def _cmd_export(args: argparse.Namespace) -> int:
    from jacobi_ext.hf.export import export

    settings = {
        "jacobi_method": args.method,
        "jacobi_block_size": args.block_size,
        "jacobi_num_blocks": args.num_blocks,
        "jacobi_pool_size": args.pool_size,
        "jacobi_lookup": args.lookup,
    }
    try:
        path, seconds = export(
            args.model,
            args.out,
            dtype=DTYPE_NAMES[args.dtype],
            device=args.device,
            settings=settings,
            measure_prompts=args.measure,
            measure_new_tokens=args.measure_tokens,
            overwrite=args.force,
        )
    except (FileExistsError, FileNotFoundError, ValueError) as exc:
        print(f"jacobi-forcing export: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path} in {seconds:.1f} s")
    print(
        "use it: AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True).generate(...)"
        "\n        transformers serve DIR --trust-remote-code   (pip install 'jacobi_ext[serve]')"
    )
    return 0


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a model as a Hugging Face folder (merged safetensors, tokenizer, "
        "generation_config with our settings, custom_generate/, model card) whose generate is "
        "Jacobi decoding; serve it with `transformers serve DIR --trust-remote-code`",
    )
    p.add_argument("--out", required=True, help="the folder to write (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="replace --out if it is not empty")
    p.add_argument("--method", default="multiblock", choices=["ar", "jacobi", "multiblock"])
    p.add_argument("--block-size", type=int, default=None, help='default: "auto" (tuned)')
    p.add_argument("--num-blocks", type=int, default=None, help="default: the engine's (2)")
    p.add_argument("--pool-size", type=int, default=None, help="default: the engine's (4)")
    p.add_argument(
        "--lookup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="context-lookup drafts (default: on for multiblock and tuned settings)",
    )
    p.add_argument(
        "--measure", type=int, default=0, metavar="N",
        help="measure AR and the folder's settings on N HumanEval prompts for the model card "
        "(default 0: no measurement)",
    )  # fmt: skip
    p.add_argument("--measure-tokens", type=int, default=128, help="new tokens per prompt")
    add_model_args(p)
    p.set_defaults(handler=_cmd_export)


def _cmd_bench(args: argparse.Namespace) -> int:
    from jacobi_ext.apps.report import cmd_bench

    return cmd_bench(args)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run the benchmark suites (pytest-benchmark) and render figures + a Markdown report",
    )
    p.add_argument("suites", nargs="*", help="decoding, verify, attention (default: all)")
    p.add_argument("--out", default="bench-results", help="folder for JSON, PNGs and REPORT.md")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke run)")
    p.add_argument("-k", default=None, help="pytest -k expression to pick benchmarks")
    p.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="JSON",
        help="baseline pytest-benchmark JSON(s): flag regressions (>10%% slower)",
    )
    p.add_argument(
        "--render-only", action="store_true", help="do not run; render the JSON already in --out"
    )
    p.add_argument(
        "--bench-dir",
        default=None,
        metavar="DIR",
        help="the suites' folder (a clone's bench/); default: the checkout this package runs from",
    )
    p.add_argument("--device", default=None, help="cpu or cuda[:i] for the decoding suites")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPE_NAMES), help="model dtype")
    p.add_argument(
        "--batch",
        default=None,
        metavar="B,B,...",
        help="also run the batch sweep at these batch sizes (e.g. 1,2,4,8,16)",
    )
    p.set_defaults(handler=_cmd_bench)


#: The entry-point group through which other packages add subcommands: each entry point names a
#: list of registrars (python_training's collect, train, distill, eval, ...: pyproject.toml,
#: ``[project.entry-points."jacobi_forcing.commands"]``). jacobi_ext imports none of them.
COMMANDS_GROUP = "jacobi_forcing.commands"

Registrar = Callable[[argparse._SubParsersAction], None]


def _entry_point_registrars() -> list[Registrar]:
    """The registrars of the installed packages' entry points (by entry-point name). A package
    whose commands fail to load is named on stderr; the other commands still work."""
    from importlib.metadata import entry_points

    out: list[Registrar] = []
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            out.extend(ep.load())
        except Exception as exc:  # a broken plugin must not take the whole CLI down
            print(
                f"jacobi-forcing: the {ep.name!r} commands ({ep.value}) did not load: {exc!r}",
                file=sys.stderr,
            )
    return out


def registrars() -> list[Registrar]:
    """Subcommand registrars, in the order `--help` lists them: the decoding commands, those
    other packages add (the distillation commands), then export, bench and info."""
    return [
        _add_demo,
        _add_generate,
        _add_tune,
        *_entry_point_registrars(),
        _add_export,
        _add_bench,
        _add_info,
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jacobi-forcing",
        description="Jacobi Forcing: decode autoregressive LLMs several times faster with the "
        "same greedy output.",
    )
    from jacobi_ext._version import __version__

    parser.add_argument("--version", action="version", version=f"jacobi_ext {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    for register in registrars():
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
