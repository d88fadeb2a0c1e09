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
    from jacobi_ext.quantized import GGUFLinear

    types = sorted({m.type_name for m in model.modules() if isinstance(m, GGUFLinear)})
    if not types:
        return str(next(model.parameters()).dtype).replace("torch.", "")
    lora = any(isinstance(m, GGUFLinear) and m.lora is not None for m in model.modules())
    return "GGUF " + "+".join(types) + (" +LoRA" if lora else "")


def run_demo(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from jacobi_ext.cli_args import sampling_kwargs
    from jacobi_ext.data import humaneval_input_ids, load_humaneval
    from jacobi_ext.decoding import generate, roofline, tuning
    from jacobi_ext.decoding.baselines import hf_greedy, hf_sample
    from jacobi_ext.models import DTYPE_NAMES, load_model
    from jacobi_ext.plots import plot_step_curve
    from jacobi_ext.quantized import is_quantized

    console = Console()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    distilled = _pick_distilled(args, console)
    dtype = DTYPE_NAMES[args.dtype]
    # The base model's transformers greedy is the speed every row is compared with; the
    # distilled model's own greedy is what its parallel decoding must reproduce exactly.
    # The baseline is the base model as transformers loads its GGUF file (dequantized); the
    # rows we decode run on the GGUF codes where they can (load_model's default on a CPU in
    # float32), and their reference greedy is transformers' on those same weights.
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
    weights = {m: _weights_label(mt[0]) for m, mt in models.items()}
    model, tok = models[shown]
    curve = tuning.step_curve(model, progress=True, full=True)
    param = next(model.parameters())  # the roofline floor beside the measured curve
    floor = roofline.floor_curve(
        roofline.machine(param.device, param.dtype), roofline.model_cost(model), curve
    )
    png = plot_step_curve(curve, out_dir / "forward_latency_vs_tokens.png", floor=floor)
    problems = load_humaneval(args.prompts)
    # Under --do-sample the baseline is transformers' sampling with the same filters, and each
    # model's reference is our own AR sample (the same noise: the parallel rows must equal it).
    samp = sampling_kwargs(args)
    sampled = bool(samp.get("do_sample"))
    if sampled and samp["seed"] is None:
        samp["seed"] = 0
    hf_name = "transformers sampling" if sampled else "transformers greedy"
    methods = [(hf_name, "base", None)]
    if shown != "base":
        methods.append((hf_name, shown, None))
    if sampled:
        methods.append(("ar (the reference sample)", shown, dict(method="ar")))
    methods += [
        ("jacobi n=16", shown, dict(method="jacobi", block_size=16)),
        ("multiblock (tuned)", shown, dict(method="multiblock")),
    ]
    totals = {
        (name, m): {"tokens": 0, "seconds": 0.0, "forwards": 0, "same": True}
        for name, m, _ in methods
    }
    for k, prob in enumerate(problems):
        ids = humaneval_input_ids(tok, prob).to(args.device)
        console.rule(
            f"[bold]{prob['task_id']}[/] ({k + 1}/{len(problems)}, prompt {ids.shape[1]} tokens)"
        )
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
    table = Table(
        title=f"{len(problems)} HumanEval prompts, {args.max_new_tokens} new tokens max, "
        f"{args.dtype}, {curve.hardware}"
    )
    ref_name = "its AR sample" if sampled else "its greedy"
    cols = ("model", "weights", "method", "settings", "tokens/s", "TPF",
            f"speedup vs base {hf_name[13:]}", f"identical to {ref_name}")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in cols[:4] else "right")
    base = totals[(hf_name, "base")]
    base_tps = base["tokens"] / base["seconds"]
    rows = []
    for (name, m), t in totals.items():
        tps = t["tokens"] / t["seconds"]
        tpf = t["tokens"] / max(t["forwards"], 1)
        rows.append(
            dict(
                model=m,
                weights=weights[m],
                method=name,
                settings=t.get("settings", "-"),
                tokens_per_s=tps,
                tpf=tpf,
                speedup=tps / base_tps,
                identical=t["same"],
            )
        )
        table.add_row(
            m,
            weights[m],
            name,
            t.get("settings", "-"),
            f"{tps:.1f}",
            f"{tpf:.2f}",
            f"{tps / base_tps:.2f}x",
            "yes" if t["same"] else "NO",
        )
    console.print(table)
    if sampled:
        console.print(
            f"[dim]sampled with seed {samp['seed']}: transformers draws from its own generator, "
            "so its rows are other samples of the same law (speed baseline only)[/]"
        )
    (out_dir / "demo_results.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "sampling": {k: v for k, v in samp.items()} if sampled else None,
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
    console.print(
        f"forward latency vs parallel tokens: [bold]{png}[/] "
        f"(knee at {curve.knee()} tokens); results: {out_dir / 'demo_results.json'}"
    )
    if distilled is None:
        console.print(
            "[dim]The base model accepts ~1 token per forward; a distilled Jacobi Forcing "
            "model (smollm2-jf, python_training) is what makes parallel decoding pay.[/]"
        )
    return 0 if all(t["same"] for t in totals.values()) else 1
