"""The curriculum (docs/method.md §2): stage 1 (n=16, W=16) on the base model's trajectories,
then each later stage regenerates trajectories with the previous stage's model (on-policy) and
trains on from its weights, as one resumable command driven by a recipe file (TOML).

On-disk layout under the recipe's ``out``::

    stage-<k>-<name>/trajectories/   collection (resumable; COLLECTED marks it complete)
    stage-<k>-<name>/train/          training (resumable; train/final is the stage's model,
                                     TRAINED marks it complete)
    final -> the last stage's train/final

Rerunning the command skips finished stages and resumes an unfinished one where it stopped.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# A recipe's dtype names (collect_dtype, [eval] dtype).
DTYPES = ("float32", "bfloat16", "float16")


def load_recipe(path: str | Path) -> dict:
    with open(path, "rb") as f:
        recipe = tomllib.load(f)
    if not recipe.get("stages"):
        raise ValueError(f"{path}: a recipe needs at least one [[stages]] table")
    return recipe


def stage_dir(out: Path, k: int, stage: dict) -> Path:
    """Stage ``k``'s folder (1-based) under a run's ``out``: ``stage-<k>-<name>``."""
    return Path(out) / f"stage-{k}-{stage.get('name', 'stage')}"


def mark_done(path: Path, info: dict) -> None:
    """Write the marker that says a step is complete (COLLECTED, TRAINED, ...) with ``info`` as
    JSON. Atomic: a marker that exists is whole, so a rerun that finds it skips the step."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, path)


def seed_from_shipped(shipped: Path, tdir: Path) -> None:
    """Start a collection from records shipped in the repo (``meta.json`` +
    ``trajectories*.jsonl.gz``), so a run on a fresh machine collects only what is missing."""
    import shutil

    if not (shipped / "meta.json").is_file():
        raise FileNotFoundError(f"{shipped} holds no meta.json: not a trajectory directory")
    tdir.mkdir(parents=True, exist_ok=True)
    if not (tdir / "meta.json").exists():
        shutil.copy(shipped / "meta.json", tdir / "meta.json")
    for f in sorted(shipped.glob("trajectories*.jsonl.gz")):
        if not (tdir / f.name).exists():
            shutil.copy(f, tdir / f.name)


def parse_dtype(name: str):
    """The torch dtype a recipe names (one of DTYPES); anything else is a ValueError."""
    import torch

    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def check_device(name: str) -> str:
    """The recipe's ``device`` ("cpu", "cuda", "cuda:1"), refused at once when it names CUDA and
    torch sees no CUDA device (else collection would fail late, and training would silently run
    on the CPU: the trainer picks the CPU when no GPU is visible)."""
    import torch

    if torch.device(name).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"the recipe asks for device {name!r}, but torch {torch.__version__} sees no CUDA "
            f"device (CUDA build: {torch.version.cuda or 'none'}): run it on a GPU machine, or "
            'override the device for a CPU run (device = "cpu", with collect_dtype = "float32")'
        )
    return name


def collect_settings(recipe: dict, stage: dict, teacher, progress: bool) -> dict:
    """The keyword arguments of ``trajectories.collect`` for ``stage`` (its block size, length,
    batch size, fixed points or whole trajectories) with ``teacher`` as the collecting model."""
    return dict(
        block_size=int(stage["block_size"]), max_new_tokens=int(stage["max_new_tokens"]),
        teacher=str(teacher or "base"),
        max_prompt_tokens=recipe.get("prompts", {}).get("max_prompt_tokens"),
        progress=progress, fixed_points_only=bool(stage.get("collect_fixed_points", False)),
        batch_size=int(stage.get("collect_batch_size", 1)),
    )  # fmt: skip


def train_settings(recipe: dict, stage: dict, teacher, sdir: Path) -> dict:
    """The TrainConfig settings of ``stage``: its [train] table, trained on from ``teacher`` on
    the stage's trajectories into its train/ folder."""
    tcfg = dict(stage.get("train", {}))
    tcfg.update(model=teacher, data=[str(sdir / "trajectories")], out=str(sdir / "train"))
    tcfg.setdefault("window", int(stage.get("window", 16)))
    tcfg.setdefault("threads", recipe.get("threads"))
    return tcfg


def collect_stage(recipe: dict, stage: dict, sdir: Path, teacher, device: str, prompts: list,
                  progress: bool) -> dict:  # fmt: skip
    """Collect the stage's trajectories with ``teacher`` (in one go: a rerun resumes by prompt
    id inside ``collect``) and mark the stage COLLECTED; returns collect's summary."""
    from jacobi_ext.models import load_model

    from .trajectories import collect

    t0 = time.perf_counter()
    tdir = sdir / "trajectories"
    if stage.get("shipped_trajectories"):
        seed_from_shipped(Path(stage["shipped_trajectories"]), tdir)
    dtype = parse_dtype(stage.get("collect_dtype", "float32"))
    model, tok = load_model(teacher, dtype=dtype, device=device)
    lo, hi = stage.get("prompt_range", [0, len(prompts)])
    summary = collect(model, tok, prompts[lo:hi], tdir,
                      **collect_settings(recipe, stage, teacher, progress))  # fmt: skip
    del model
    summary["wall_seconds"] = time.perf_counter() - t0
    mark_done(sdir / "COLLECTED", summary)
    return summary


def train_stage(recipe: dict, stage: dict, sdir: Path, teacher, progress: bool) -> dict:
    """Train the stage from ``teacher`` and mark it TRAINED, unless the trainer stopped early
    (a chunk of a long run: the same command goes on); returns the trainer's last row."""
    from .trainer import TrainConfig, train

    t0 = time.perf_counter()
    last = train(TrainConfig.from_dict(train_settings(recipe, stage, teacher, sdir)),
                 progress=progress)  # fmt: skip
    last["wall_seconds"] = time.perf_counter() - t0
    if not last.get("stopped_early"):
        mark_done(sdir / "TRAINED", last)
    return last


def link_final(out: Path, model_dir: str | Path) -> Path:
    """``out/final``, a link to the last stage's model (replaced when it exists)."""
    link = Path(out) / "final"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path(model_dir).resolve())
    return link


def run_recipe(recipe: dict, out: str | Path | None = None, progress: bool = True) -> Path:
    """Run (or resume) every stage of ``recipe``; returns the final model's directory."""
    import torch

    from .prompts import load_prompts

    out = Path(out or recipe.get("out", "runs/distill"))
    device = check_device(recipe.get("device", "cpu"))  # collection's; training: accelerate's
    out.mkdir(parents=True, exist_ok=True)
    if recipe.get("threads"):
        torch.set_num_threads(int(recipe["threads"]))
    prompts = load_prompts(recipe.get("prompts", {}).get("source"), None)
    teacher = recipe.get("model") or None
    for k, st in enumerate(recipe["stages"], 1):
        sdir = stage_dir(out, k, st)
        # Collection: the base model for stage 1, the previous stage's model after that.
        if not (sdir / "COLLECTED").exists():
            summary = collect_stage(recipe, st, sdir, teacher, device, prompts, progress)
            print(f"stage {k}: collected {summary}", flush=True)
        if not (sdir / "TRAINED").exists():
            last = train_stage(recipe, st, sdir, teacher, progress)
            if last.get("stopped_early"):
                print(f"stage {k}: chunk ended at step {last.get('step')}; rerun to go on")
                return sdir / "train"
            print(f"stage {k}: trained {last}", flush=True)
        teacher = str(sdir / "train" / "final")
    return link_final(out, teacher)
