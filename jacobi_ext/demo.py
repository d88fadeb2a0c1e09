"""`jacobi-forcing demo`: decode HumanEval prompts with transformers greedy, `jacobi` and
`multiblock`, show the text as it is committed (one colour per forward pass, so the tokens each
forward accepted are visible), then a table of speed and whether outputs equal greedy."""

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


def run_demo(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from jacobi_ext.data import humaneval_input_ids, load_humaneval
    from jacobi_ext.decoding import generate, tuning
    from jacobi_ext.decoding.baselines import hf_greedy
    from jacobi_ext.models import load_from_args
    from jacobi_ext.plots import plot_step_curve

    console = Console()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.model is None and not args.base:
        from jacobi_ext.models import find_distilled

        found = find_distilled()
        if found is not None:
            args.model = str(found)
            console.print(
                f"using the distilled checkpoint [bold]{found}[/] "
                "(pass --base for the base model, --model for another one)"
            )
    with console.status(f"loading {args.model or 'SmolLM2-135M-Instruct'} (offline)"):
        model, tok = load_from_args(args)
    curve = tuning.step_curve(model, progress=True)
    png = plot_step_curve(curve, out_dir / "forward_latency_vs_tokens.png")
    problems = load_humaneval(args.prompts)
    methods = [
        ("transformers greedy", None),
        ("jacobi n=16", dict(method="jacobi", block_size=16)),
        ("multiblock (tuned)", dict(method="multiblock")),
    ]
    totals = {
        name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "same": True} for name, _ in methods
    }
    for k, prob in enumerate(problems):
        ids = humaneval_input_ids(tok, prob).to(args.device)
        console.rule(
            f"[bold]{prob['task_id']}[/] ({k + 1}/{len(problems)}, prompt {ids.shape[1]} tokens)"
        )
        ref, dt = hf_greedy(model, ids, args.max_new_tokens)
        t = totals["transformers greedy"]
        t["tokens"] += len(ref)
        t["seconds"] += dt
        t["forwards"] += max(len(ref) - 1, 0)
        for name, kw in methods[1:]:
            show = not args.quiet and name.startswith("multiblock")
            if show:
                console.print(f"[dim]{name}: each colour is one forward pass[/]")
            streamer = ForwardColourStreamer(tok, console, enabled=show)
            res = generate(model, ids, max_new_tokens=args.max_new_tokens, streamer=streamer, **kw)
            t = totals[name]
            t["tokens"] += res.new_tokens
            t["seconds"] += res.seconds
            t["forwards"] += res.forwards
            t["same"] &= res.tokens[0].tolist() == ref
            t["settings"] = f"{res.method} n={res.block_size} K={res.num_blocks} p={res.pool_size}"
    table = Table(
        title=f"{len(problems)} HumanEval prompts, {args.max_new_tokens} new tokens max, "
        f"{args.dtype}, {curve.hardware}"
    )
    for col in ("method", "settings", "tokens/s", "TPF", "speedup", "identical to greedy"):
        table.add_column(col, justify="right" if col not in ("method", "settings") else "left")
    base = totals["transformers greedy"]
    base_tps = base["tokens"] / base["seconds"]
    rows = []
    for name, t in totals.items():
        tps = t["tokens"] / t["seconds"]
        tpf = t["tokens"] / max(t["forwards"], 1)
        rows.append(
            dict(
                method=name,
                settings=t.get("settings", "-"),
                tokens_per_s=tps,
                tpf=tpf,
                speedup=tps / base_tps,
                identical=t["same"],
            )
        )
        table.add_row(
            name,
            t.get("settings", "-"),
            f"{tps:.1f}",
            f"{tpf:.2f}",
            f"{tps / base_tps:.2f}x",
            "yes" if t["same"] else "NO",
        )
    console.print(table)
    (out_dir / "demo_results.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "curve": {
                    "sizes": curve.sizes,
                    "seconds": curve.seconds,
                    "hardware": curve.hardware,
                    "dtype": curve.dtype,
                },
            },
            indent=1,
        )
    )
    console.print(
        f"forward latency vs parallel tokens: [bold]{png}[/] "
        f"(knee at {curve.knee()} tokens); results: {out_dir / 'demo_results.json'}"
    )
    console.print(
        "[dim]The base model accepts ~1 token per forward; a distilled Jacobi Forcing "
        "checkpoint (python_training) is what makes parallel decoding pay.[/]"
    )
    return 0 if all(t["same"] for t in totals.values()) else 1
