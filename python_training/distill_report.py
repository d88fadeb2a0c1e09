"""What a distillation run produced, as figures and a table: the training curves of every stage
and the held-out scaling curve (tokens per forward vs training trajectories seen).

Works on the directory layout of ``distill.py``::

    <run>/stage-<k>-<name>/train/log.jsonl           one row per optimizer step
    <run>/stage-<k>-<name>/train/snapshots/step-N/   HF snapshots (``snapshot_every``)
    <run>/stage-<k>-<name>/train/final/              the stage's model

The scaling curve decodes the first ``limit`` HumanEval problems (held out: training prompts
come from the stdlib) with plain Jacobi at a fixed block size and records tokens per forward;
TPF does not depend on machine load, so it can be measured while other jobs run. Results are
appended to ``scaling.jsonl`` one model at a time, so an interrupted report resumes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def read_log(path: str | Path) -> list[dict]:
    """The rows of a trainer ``log.jsonl``; a step logged twice (redone after a resume) keeps
    its last row."""
    rows = {int(r["step"]): r for r in _rows(Path(path))}
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


def scaling_points(run: str | Path) -> list[dict]:
    """The models of the scaling curve: the base model (teacher of stage 1, ``model=None``),
    every snapshot and every stage's final model, with the cumulative number of training
    trajectories each had seen."""
    pts = [{"label": "base", "model": None, "examples": 0, "stage": 0}]
    seen = 0
    for k, st in enumerate(stages(run), 1):
        snaps = sorted((st["train"] / "snapshots").glob("step-*"),
                       key=lambda p: int(p.name.split("-")[1]))  # fmt: skip
        steps_done = st["log"][-1]["step"] if st["log"] else 0
        for s in snaps:
            step = int(s.name.split("-")[1])
            if step < steps_done and (s / "model.safetensors").exists():
                pts.append({"label": f"{st['name']}/step-{step}", "model": str(s),
                            "examples": seen + int(step * st["per_step"]), "stage": k})  # fmt: skip
        if (st["final"] / "model.safetensors").exists():
            seen += int(steps_done * st["per_step"])
            pts.append({"label": f"{st['name']}/final", "model": str(st["final"]),
                        "examples": seen, "stage": k})  # fmt: skip
    return pts


def heldout_tpf(model, tokenizer, limit: int, max_new_tokens: int, block_size: int) -> dict:
    import torch

    from jacobi_ext.data import humaneval_input_ids, load_humaneval
    from jacobi_ext.decoding import generate

    tok = fw = 0
    eos = model.generation_config.eos_token_id
    for p in load_humaneval(limit):
        ids = humaneval_input_ids(tokenizer, p)
        with torch.inference_mode():
            r = generate(model, ids, method="jacobi", block_size=block_size,
                         max_new_tokens=max_new_tokens, eos_token_id=eos)  # fmt: skip
        tok, fw = tok + r.new_tokens, fw + r.forwards
    return {"tokens": tok, "forwards": fw, "tpf": tok / max(fw, 1)}


def measure_scaling(
    run, results, limit=12, max_new_tokens=128, block_size=16, base=None, progress=True
):
    """Append held-out TPF for every scaling point not yet in ``results`` (JSONL); ``base`` is
    the run's base model (default: SmolLM2-135M-Instruct, as in the recipes)."""
    from tqdm.auto import tqdm

    from jacobi_ext.models import load_model

    results = Path(results)
    done = {r["label"] for r in _rows(results)}
    todo = [p for p in scaling_points(run) if p["label"] not in done]
    for p in tqdm(todo, desc="held-out TPF", unit="model", disable=not progress):
        model, tok = load_model(p["model"] or base)
        row = dict(p, **heldout_tpf(model, tok, limit, max_new_tokens, block_size),
                   prompts=limit, max_new_tokens=max_new_tokens, block_size=block_size)  # fmt: skip
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
    return _rows(results)


def _rows(path: Path) -> list[dict]:
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
    """Held-out TPF vs trajectories seen, one marker colour per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: (r["examples"], r["stage"]))
    if not rows or any(not math.isfinite(r["tpf"]) for r in rows):
        raise ValueError("scaling rows missing or not finite")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot([r["examples"] for r in rows], [r["tpf"] for r in rows], color="gray", lw=1)
    for k in sorted({r["stage"] for r in rows}):
        rs = [r for r in rows if r["stage"] == k]
        ax.plot([r["examples"] for r in rs], [r["tpf"] for r in rs], "o",
                label="base model" if k == 0 else f"stage {k}")  # fmt: skip
    r0 = rows[0]
    ax.set_xlabel("training trajectories seen")
    ax.set_ylabel(f"held-out TPF (Jacobi n={r0['block_size']})")
    ax.set_title(f"HumanEval[:{r0['prompts']}], {r0['max_new_tokens']} new tokens")
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
