"""`jacobi-forcing demo`: decode HumanEval prompts with the base model's transformers greedy,
then with the distilled model (the shipped smollm2-jf adapter, when there is one) by its own
greedy, `jacobi` and the tuned `multiblock`; show the text as it is committed (one colour per
forward pass, so the tokens each forward accepted are visible), then a table of speed against
the base model's greedy and whether each output equals its model's own greedy (lossless)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red")


class ForwardColourStreamer:
    """transformers-style streamer (put/end) that prints each forward's committed tokens in the
    next colour. Text is decoded incrementally so multi-token characters come out whole."""

    def __init__(self, tokenizer, console, enabled: bool = True) -> None:
        self.tok, self.console, self.enabled = tokenizer, console, enabled
        self.ids: list[int] = []
        self.text = ""
        self.steps = 0
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.ids += value.reshape(-1).tolist()
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        new, self.text = text[len(self.text) :], text
        if self.enabled and new:
            from rich.text import Text

            self.console.print(Text(new, style=_COLOURS[self.steps % len(_COLOURS)]), end="")
        self.steps += 1

    def end(self) -> None:
        if self.enabled:
            self.console.print()


def _pick_distilled(args, console) -> str | None:
    """The distilled model the demo shows: --model if given, else the adapter shipped with the
    library (smollm2-jf), else the newest ./runs/*/final; None with --base."""
    from jacobi_ext.models import ADAPTERS, DISTILLED_MODEL, find_distilled

    if args.base:
        return None
    if args.model is not None:
        return args.model
    if (ADAPTERS[DISTILLED_MODEL] / "adapter_model.safetensors").is_file():
        return DISTILLED_MODEL
    found = find_distilled()
    if found is not None:
        console.print(f"using the distilled checkpoint [bold]{found}[/] (--base: base model only)")
    return str(found) if found is not None else None


def _weights_label(model) -> str:
    """What a model's linears read, for the table: 'GGUF Q4_1' (+ 'LoRA') or its dtype."""
    from jacobi_ext.models.quantized import GGUFLinear

    types = sorted({m.type_name for m in model.modules() if isinstance(m, GGUFLinear)})
    if not types:
        return str(next(model.parameters()).dtype).replace("torch.", "")
    lora = any(isinstance(m, GGUFLinear) and m.lora is not None for m in model.modules())
    return "GGUF " + "+".join(types) + (" +LoRA" if lora else "")


#: The table's short method labels: the row's name (as in demo_results.json) -> (label, what
#: the legend says, the method the row asked `generate` for; None for transformers' own rows).
_METHODS = {
    "transformers greedy": ("hf", "transformers' greedy (its own generate)", None),
    "transformers sampling": ("hf", "transformers' sampling, the same filters", None),
    "ar (the reference sample)": ("ar", "our AR sample: the reference of the parallel rows", "ar"),
    "jacobi n=16": ("jacobi", "plain Jacobi decoding, one block of n=16 tokens", "jacobi"),
    "multiblock (tuned)": ("tuned", "multiblock, the tuner's settings (the default)", "multiblock"),
}


#: What the legend calls the base model's two rows (other models by their name or path).
_MODEL_NAMES = {
    "base": "SmolLM2-135M-Instruct as transformers loads it",
    "base (codes)": "SmolLM2-135M-Instruct read on its GGUF codes",
}


def _model_label(name: str) -> str:
    """A model's short label in the table (the legend spells it out)."""
    from jacobi_ext.models import DISTILLED_MODEL

    return {"base": "base", "base (codes)": "codes", DISTILLED_MODEL: "jf"}.get(name, "dist")


def _short_settings(settings: str, asked: str | None) -> str:
    """'multiblock+lookup n=16 K=2 p=4' (a row's settings in demo_results.json) as the table
    shows it: 'n=16 K=2 p=4 +lookup', the method named only where the tuner chose another one
    than the row asked for, and only the settings that method reads."""
    if asked is None or settings == "-":
        return "-"
    method, *pairs = settings.split()
    base, _, extra = method.partition("+")
    kv = dict(p.split("=", 1) for p in pairs)
    words = [] if base == asked else [base]
    if base == "jacobi":
        words.append(f"n={kv['n']}")
    elif base == "multiblock":
        words += [f"n={kv['n']}", f"K={kv['K']}", f"p={kv['p']}"]
    words += [f"+{extra}"] if extra else []
    return " ".join(words) or "-"


def results_table(rows: list[dict], title: str, caption: str, sampled: bool):
    """The demo's table of `rows` (demo_results.json's) and the legend printed under it, which
    spells out the table's short labels; both fit an 80-column terminal with one line a row."""
    from rich.table import Table

    table = Table(title=title, caption=caption)
    cols = ("model", "method", "settings", "tok/s", "TPF", "speedup", "lossless")
    for col in cols:
        table.add_column(col, justify="left" if col in cols[:3] else "right", no_wrap=True)
    for r in rows:
        label, _, asked = _METHODS[r["method"]]
        table.add_row(
            _model_label(r["model"]),
            label,
            _short_settings(r["settings"], asked),
            f"{r['tokens_per_s']:.1f}",
            f"{r['tpf']:.2f}",
            f"{r['speedup']:.2f}x",
            "yes" if r["identical"] else "NO",
        )
    legend = Table.grid(padding=(0, 2))
    legend.add_column(style="bold", no_wrap=True)
    legend.add_column(style="dim")
    for m, weights in dict.fromkeys((r["model"], r["weights"]) for r in rows):
        name = _MODEL_NAMES.get(m, m)
        legend.add_row(_model_label(m), f"{name}, {weights} weights")
    for name in dict.fromkeys(r["method"] for r in rows):
        label, text, _ = _METHODS[name]
        legend.add_row(label, text)
    ref = "its model's ar row (the same seed)" if sampled else "its model's hf row (greedy)"
    legend.add_row("settings", "n tokens a block, K blocks, p candidates; +lookup: context drafts")
    legend.add_row("TPF", "tokens per forward; speedup: tokens/s over base's hf row")
    legend.add_row("lossless", f"the output is identical to {ref}")
    return table, legend


def _load_models(args, console) -> tuple[dict, str, str | None]:
    """(model name -> (model, tokenizer), the name of the model the demo decodes, the
    distilled model or None). The base model's transformers greedy is the speed every row is
    compared with; the distilled model's own greedy is what its parallel decoding must
    reproduce exactly. The baseline is the base model as transformers loads its GGUF file
    (dequantized); the rows we decode run on the GGUF codes where they can (load_model's
    default on a CPU in float32), and their reference greedy is transformers' on those same
    weights."""
    from jacobi_ext.models import DTYPE_NAMES, load_model
    from jacobi_ext.models.quantized import is_quantized

    distilled = _pick_distilled(args, console)
    dtype = DTYPE_NAMES[args.dtype]
    dequantize = True if getattr(args, "dequantize", False) else None
    models = {}
    with console.status("loading SmolLM2-135M-Instruct (offline)"):
        models["base"] = load_model(None, dtype=dtype, device=args.device, dequantize=True)
    shown = distilled if distilled is not None else "base (codes)"
    with console.status(f"loading {shown} (offline)"):
        loaded = load_model(distilled, dtype=dtype, device=args.device, dequantize=dequantize)
    if is_quantized(loaded[0]) or distilled is not None:
        models[shown] = loaded
    else:  # the base model, dequantized as asked: one copy serves every row
        shown, models["base"] = "base", loaded
    return models, shown, distilled


def _forward_curve(model, out_dir: Path):
    """This machine's forward latency against parallel tokens, its roofline floor, and the
    figure of both: (curve, floor, png path)."""
    from jacobi_ext.apps.plots import plot_step_curve
    from jacobi_ext.decoding import tuning
    from jacobi_ext.tools import roofline

    curve = tuning.step_curve(model, progress=True, full=True)
    floor = roofline.floor_curve(*roofline.model_machine(model), curve)
    png = plot_step_curve(curve, out_dir / "forward_latency_vs_tokens.png", floor=floor)
    return curve, floor, png


def _sampling(args) -> tuple[dict, bool, str]:
    """(generate's sampling kwargs, whether the demo samples, the baseline rows' name). Under
    --do-sample the baseline is transformers' sampling with the same filters, and each model's
    reference is our own AR sample (the same noise: the parallel rows must equal it)."""
    from jacobi_ext.apps.cli_args import sampling_kwargs

    samp = sampling_kwargs(args)
    sampled = bool(samp.get("do_sample"))
    if sampled and samp["seed"] is None:
        samp["seed"] = 0
    return samp, sampled, "transformers sampling" if sampled else "transformers greedy"


def _methods(shown: str, hf_name: str, sampled: bool) -> list[tuple[str, str, dict | None]]:
    """The rows to decode, in order: (name, model, generate's kwargs; None for transformers)."""
    methods = [(hf_name, "base", None)]
    if shown != "base":
        methods.append((hf_name, shown, None))
    if sampled:
        methods.append(("ar (the reference sample)", shown, dict(method="ar")))
    methods += [
        ("jacobi n=16", shown, dict(method="jacobi", block_size=16)),
        ("multiblock (tuned)", shown, dict(method="multiblock")),
    ]
    return methods


def _decode_prompt(args, console, models, tok, ids, methods, samp, totals) -> None:
    """Decode one prompt by every row's method, adding to `totals`; the tuned row is shown
    live (one colour per forward) unless --quiet."""
    from jacobi_ext.decoding import generate
    from jacobi_ext.tools.baselines import hf_greedy, hf_sample

    sampled = bool(samp.get("do_sample"))
    refs = {}
    for name, m, kw in methods:
        t = totals[(name, m)]
        if kw is None:
            if sampled:
                filters = {k: v for k, v in samp.items() if k not in ("do_sample", "seed")}
                toks, dt = hf_sample(models[m][0], ids, args.max_new_tokens, samp["seed"],
                                     **filters)  # fmt: skip
            else:
                toks, dt = hf_greedy(models[m][0], ids, args.max_new_tokens)
                refs[m] = toks
            t["tokens"] += len(toks)
            t["seconds"] += dt
            t["forwards"] += max(len(toks) - 1, 0)
            continue
        show = not args.quiet and name.startswith("multiblock")
        if show:
            console.print(f"[dim]{m}, {name}: each colour is one forward pass[/]")
        streamer = ForwardColourStreamer(tok, console, enabled=show)
        res = generate(
            models[m][0], ids, max_new_tokens=args.max_new_tokens, streamer=streamer, **kw,
            **samp,
        )  # fmt: skip
        if sampled and kw.get("method") == "ar":
            refs[m] = res.tokens[0].tolist()
        t["tokens"] += res.new_tokens
        t["seconds"] += res.seconds
        t["forwards"] += res.forwards
        t["same"] &= res.tokens[0].tolist() == refs[m]
        t["settings"] = f"{res.method} n={res.block_size} K={res.num_blocks} p={res.pool_size}"


def _rows(totals: dict, weights: dict, hf_name: str) -> list[dict]:
    """demo_results.json's rows: each method's speed, tokens per forward, speedup against the
    base model's transformers row, and whether its output equals its model's reference."""
    base = totals[(hf_name, "base")]
    base_tps = base["tokens"] / base["seconds"]
    rows = []
    for (name, m), t in totals.items():
        tps = t["tokens"] / t["seconds"]
        rows.append(
            dict(
                model=m,
                weights=weights[m],
                method=name,
                settings=t.get("settings", "-"),
                tokens_per_s=tps,
                tpf=t["tokens"] / max(t["forwards"], 1),
                speedup=tps / base_tps,
                identical=t["same"],
            )
        )
    return rows


def _modes(model, console):
    """Which CPU mode is faster here (tools/modes.py; the table then says it); None off a
    CPU."""
    from jacobi_ext.tools.modes import compare_modes

    if next(model.parameters()).device.type != "cpu":
        return None
    with console.status("timing a one-token forward exact and on 8-bit activations"):
        return compare_modes(model)


def _write_results(path: Path, rows: list[dict], samp: dict | None, curve, floor,
                   modes=None) -> None:  # fmt: skip
    path.write_text(
        json.dumps(
            {
                "modes": modes.as_dict() if modes is not None else None,
                "rows": rows,
                "sampling": dict(samp) if samp is not None else None,
                "curve": {
                    "sizes": curve.sizes,
                    "seconds": curve.seconds,
                    "hardware": curve.hardware,
                    "dtype": curve.dtype,
                    "floor": floor,
                },
            },
            indent=1,
        )
    )


def run_demo(args) -> int:
    """Load the models, measure the forward curve, decode the prompts by every row's method,
    then print the table and write demo_results.json; 1 if any output was not lossless."""
    from rich.console import Console

    from jacobi_ext.data import humaneval_input_ids, load_humaneval

    console = Console()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    samp, sampled, hf_name = _sampling(args)
    models, shown, distilled = _load_models(args, console)
    weights = {m: _weights_label(mt[0]) for m, mt in models.items()}
    model, tok = models[shown]
    curve, floor, png = _forward_curve(model, out_dir)
    modes = _modes(model, console)
    problems = load_humaneval(args.prompts)
    methods = _methods(shown, hf_name, sampled)
    totals = {
        (name, m): {"tokens": 0, "seconds": 0.0, "forwards": 0, "same": True}
        for name, m, _ in methods
    }
    for k, prob in enumerate(problems):
        ids = humaneval_input_ids(tok, prob).to(args.device)
        console.rule(
            f"[bold]{prob['task_id']}[/] ({k + 1}/{len(problems)}, prompt {ids.shape[1]} tokens)"
        )
        _decode_prompt(args, console, models, tok, ids, methods, samp, totals)
    rows = _rows(totals, weights, hf_name)
    title = f"{len(problems)} HumanEval prompts, {args.max_new_tokens} new tokens max, {args.dtype}"
    table, legend = results_table(rows, title, curve.hardware, sampled)
    console.print(table)
    console.print(legend)
    if sampled:
        console.print(
            f"[dim]sampled with seed {samp['seed']}: transformers draws from its own generator, "
            "so its rows are other samples of the same law (speed baseline only)[/]"
        )
    if modes is not None:
        console.print(f"[bold]mode:[/] {modes.advice()}")
    results = out_dir / "demo_results.json"
    _write_results(results, rows, samp if sampled else None, curve, floor, modes)
    console.print(
        f"forward latency vs parallel tokens: [bold]{png}[/] "
        f"(knee at {curve.knee()} tokens); results: {results}"
    )
    if distilled is None:
        console.print(
            "[dim]The base model accepts ~1 token per forward; a distilled Jacobi Forcing "
            "model (smollm2-jf, python_training) is what makes parallel decoding pay.[/]"
        )
    return 0 if all(r["identical"] for r in rows) else 1
