"""What a distillation run produced, as figures and a table: the training curves of every stage
and the held-out scaling curve (tokens per forward vs training trajectories seen).

Works on the directory layout of ``distill.py``::

    <run>/stage-<k>-<name>/train/log.jsonl           one row per optimizer step
    <run>/stage-<k>-<name>/train/snapshots/step-N/   HF snapshots (``snapshot_every``)
    <run>/stage-<k>-<name>/train/final/              the stage's model

The scaling curve decodes the first ``limit`` prompts of each held-out set (HumanEval, and the
installed-code prompts of packages training never saw) with plain Jacobi and ``multiblock``
(no lookup) at a fixed block size, and the first training prompts with plain Jacobi, and records
tokens per forward; TPF does not depend on machine load, so it can be measured while other jobs
run. Results are appended to ``scaling.jsonl`` one model at a time, so an interrupted report
resumes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def read_log(path: str | Path) -> list[dict]:
    """The rows of a trainer ``log.jsonl``; a step logged twice (redone after a resume) keeps
    its last row."""
    rows = {int(r["step"]): r for r in read_rows(Path(path))}
    return [rows[k] for k in sorted(rows)]


def stages(run: str | Path) -> list[dict]:
    """Per stage, in order: name, train dir, log rows, examples per step, final model dir."""
    out = []
    for sdir in sorted(Path(run).glob("stage-*"), key=lambda p: int(p.name.split("-")[1])):
        tdir = sdir / "train"
        log = read_log(tdir / "log.jsonl") if (tdir / "log.jsonl").exists() else []
        per_step = (log[-1].get("examples", log[-1]["step"]) / log[-1]["step"]) if log else 1
        out.append({"name": sdir.name, "train": tdir, "log": log, "per_step": per_step,
                    "final": tdir / "final"})  # fmt: skip
    return out


def _is_model(d: Path) -> bool:
    """A full HF snapshot or a LoRA adapter snapshot (load_model merges the latter)."""
    return (d / "model.safetensors").exists() or (d / "adapter_model.safetensors").exists()


def _tokens_at(log: list[dict], step: int) -> int | None:
    """Training tokens seen after ``step`` (the log's tokens_seen, else the sum of tokens)."""
    seen = 0
    for r in log:
        seen = r.get("tokens_seen", seen + r.get("tokens", 0))
        if r["step"] == step:
            return seen
    return None


def scaling_points(run: str | Path) -> list[dict]:
    """The models of the scaling curve: the base model (teacher of stage 1, ``model=None``),
    every snapshot (full or adapter) and every stage's final model, with the cumulative number
    of training trajectories and packed training tokens each had seen."""
    pts = [{"label": "base", "model": None, "examples": 0, "tokens": 0, "stage": 0}]
    seen = tokens = 0
    for k, st in enumerate(stages(run), 1):
        snaps = sorted((st["train"] / "snapshots").glob("step-*"),
                       key=lambda p: int(p.name.split("-")[1]))  # fmt: skip
        steps_done = st["log"][-1]["step"] if st["log"] else 0
        for s in snaps:
            step = int(s.name.split("-")[1])
            # A snapshot at the last step is the final model, unless the stage has not finished
            # (a chunked run): then it is the newest point.
            has_final = (st["final"] / "model.safetensors").exists()
            if _is_model(s) and (step < steps_done or (step == steps_done and not has_final)):
                pts.append({"label": f"{st['name']}/step-{step}", "model": str(s),
                            "examples": seen + int(step * st["per_step"]),
                            "tokens": tokens + (_tokens_at(st["log"], step) or 0),
                            "stage": k})  # fmt: skip
        if (st["final"] / "model.safetensors").exists():
            seen += int(steps_done * st["per_step"])
            tokens += _tokens_at(st["log"], steps_done) or 0
            pts.append({"label": f"{st['name']}/final", "model": str(st["final"]),
                        "examples": seen, "tokens": tokens, "stage": k})  # fmt: skip
    return pts


# The held-out sets of the curve: HumanEval (the paper's benchmark) and the installed-code
# prompts of packages training never saw (prompt_corpus.HELDOUT_PACKAGES).
HELDOUT_SETS = ("humaneval", "code-heldout")
# The first prompts of the training split ("code"), which the run trained on: held-out TPF that
# flattens while this one rises is a generalisation gap (more prompts help); both flat is the
# model or the optimisation (more data would not). Plain Jacobi only, to keep the report short.
TRAIN_SET = "code"
REPORT_SETS = HELDOUT_SETS + (TRAIN_SET,)
SET_METHODS = {TRAIN_SET: ("jacobi",)}
# Plain Jacobi and multiblock WITHOUT context lookup: lookup drafts copy text and would make a
# base model look distilled, so they never stand as evidence of distillation.
CURVE_METHODS = {
    "jacobi": dict(method="jacobi", lookup=False),
    "multiblock": dict(method="multiblock", num_blocks=2, pool_size=4, lookup=False),
}


def heldout_inputs(tokenizer, which: str, limit: int) -> list:
    from jacobi_ext.data import humaneval_input_ids, load_humaneval

    if which == "humaneval":
        return [humaneval_input_ids(tokenizer, p) for p in load_humaneval(limit)]
    from .prompts import load_prompts

    return [p.input_ids(tokenizer) for p in load_prompts(which, limit)]


def heldout_tpf(
    model, tokenizer, limit: int, max_new_tokens: int, block_size: int, sets=HELDOUT_SETS
) -> dict:
    """TPF of each curve method on the first ``limit`` prompts of each held-out set, as
    ``{"<set>/<method>": {"tokens", "forwards", "tpf"}}``, plus ``"tpf"``: plain Jacobi on
    HumanEval (the figure older reports used)."""
    import torch

    from jacobi_ext.decoding import generate

    eos = model.generation_config.eos_token_id
    out = {}
    for which in sets:
        inputs = heldout_inputs(tokenizer, which, limit)
        for name, kw in CURVE_METHODS.items():
            if name not in SET_METHODS.get(which, CURVE_METHODS):
                continue
            tok = fw = 0
            for ids in inputs:
                with torch.inference_mode():
                    r = generate(model, ids, block_size=block_size,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos, **kw)  # fmt: skip
                tok, fw = tok + r.new_tokens, fw + r.forwards
            out[f"{which}/{name}"] = {"tokens": tok, "forwards": fw, "tpf": tok / max(fw, 1)}
    if "humaneval/jacobi" in out:
        out["tpf"] = out["humaneval/jacobi"]["tpf"]
    return out


def _missing_sets(row: dict, sets) -> tuple:
    """The sets a row of ``scaling.jsonl`` has no figure for (rows of older reports lack the
    newer sets)."""
    return tuple(w for w in sets if not any(k.startswith(f"{w}/") for k in row))


def measure_scaling(
    run, results, limit=12, max_new_tokens=128, block_size=16, base=None, progress=True,
    sets=REPORT_SETS,
):  # fmt: skip
    """Measure TPF on ``sets`` for every scaling point: a point not yet in ``results`` (JSONL)
    is appended; a row measured before a set was added gets that set only (the file is
    rewritten atomically). ``base`` is the run's base model (default: SmolLM2-135M-Instruct,
    as in the recipes)."""
    from tqdm.auto import tqdm

    from jacobi_ext.models import load_model

    results = Path(results)
    rows = {r["label"]: r for r in read_rows(results)}
    todo = []
    for p in scaling_points(run):
        old = rows.get(p["label"])
        if old is None:
            todo.append((p, tuple(sets)))
        elif (old.get("prompts"), old.get("max_new_tokens")) == (limit, max_new_tokens) and (
            miss := _missing_sets(old, sets)
        ):
            todo.append((old, miss))
    for p, which in tqdm(todo, desc="held-out TPF", unit="model", disable=not progress):
        model, tok = load_model(p["model"] or base)
        got = heldout_tpf(model, tok, limit, max_new_tokens, block_size, which)
        if p["label"] in rows:  # complete an older row in place
            rows[p["label"]] = {**p, **{k: v for k, v in got.items() if k != "tpf"}}
            _rewrite(results, list(rows.values()))
            continue
        row = dict(p, **got, prompts=limit, max_new_tokens=max_new_tokens, block_size=block_size)
        rows[p["label"]] = row
        append_row(results, row)
    return read_rows(results)


def _rewrite(path: Path, rows: list[dict]) -> None:
    """Replace a JSONL file by ``rows`` without a moment where it is partly written."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def append_row(path: str | Path, row: dict) -> None:
    """Append ``row`` to a JSONL file and sync it to disk: a job killed right after keeps it."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_rows(path: str | Path) -> list[dict]:
    """The records of a JSONL file (none if it does not exist), skipping blank lines and the
    torn last line an interrupted writer may leave."""
    if not Path(path).exists():
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _smooth(xs: list[float], k: int) -> list[float]:
    out, acc = [], []
    for x in xs:
        acc.append(x)
        acc = acc[-k:]
        out.append(sum(acc) / len(acc))
    return out


def plot_training(run, path, smooth: int = 20) -> Path:
    """AR and consistency loss per optimizer step, all stages on one step axis (moving mean of
    ``smooth`` steps over the raw values, which are one packed sequence each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    offset = 0
    for st in stages(run):
        if not st["log"]:
            continue
        steps = [offset + r["step"] for r in st["log"]]
        for ax, key in zip(axes, ("ar", "consistency"), strict=True):
            ys = [r[key] for r in st["log"]]
            ax.plot(steps, ys, alpha=0.2, lw=0.8)
            ax.plot(steps, _smooth(ys, smooth), lw=2, label=st["name"])
        offset = steps[-1]
        for ax in axes:
            ax.axvline(offset, color="gray", ls=":", lw=1)
    axes[0].set_title("AR loss (hard CE)")
    axes[1].set_title("consistency loss (soft CE to clean block)")
    for ax in axes:
        ax.set_xlabel("optimizer step (all stages)")
        ax.set_ylabel("loss")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_scaling(rows: list[dict], path) -> Path:
    """Held-out TPF vs packed training tokens seen: one line per held-out set and method
    (rows of older reports, with HumanEval plain Jacobi alone, plot that one line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: (r.get("tokens", r["examples"]), r["stage"]))
    if not rows or any(not math.isfinite(r["tpf"]) for r in rows):
        raise ValueError("scaling rows missing or not finite")
    keys = [f"{w}/{m}" for w in REPORT_SETS for m in CURVE_METHODS if f"{w}/{m}" in rows[0]]
    x_key = "tokens" if all("tokens" in r for r in rows) else "examples"
    xs = [r[x_key] / (1e6 if x_key == "tokens" else 1) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key in keys or ["tpf"]:
        pts = [(x, r[key]["tpf"] if key != "tpf" else r["tpf"])
               for x, r in zip(xs, rows, strict=True) if key == "tpf" or key in r]  # fmt: skip
        seen = key.startswith(f"{TRAIN_SET}/")  # the training prompts: dashed
        label = "humaneval/jacobi" if key == "tpf" else ("training prompts/" + key.split("/")[1]
                                                          if seen else key)  # fmt: skip
        ax.plot(*zip(*pts, strict=True), "o--" if seen else "o-", label=label)
    r0 = rows[0]
    ax.set_xlabel("packed training tokens seen (M)" if x_key == "tokens" else "trajectories")
    ax.set_ylabel(f"tokens per forward (n={r0['block_size']})")
    ax.set_title(f"first {r0['prompts']} prompts of each set, {r0['max_new_tokens']} new tokens, "
                 "no lookup")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def report(
    run, out, limit=12, max_new_tokens=128, block_size=16, scaling=True, base=None, progress=True
):
    """Write training_curves.png, and with ``scaling`` scaling.jsonl + scaling.png, into out."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = [plot_training(run, out / "training_curves.png")]
    if scaling:
        rows = measure_scaling(run, out / "scaling.jsonl", limit, max_new_tokens, block_size,
                               base, progress)  # fmt: skip
        files.append(plot_scaling(rows, out / "scaling.png"))
    return files
