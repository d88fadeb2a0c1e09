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


def load_recipe(path: str | Path) -> dict:
    with open(path, "rb") as f:
        recipe = tomllib.load(f)
    if not recipe.get("stages"):
        raise ValueError(f"{path}: a recipe needs at least one [[stages]] table")
    return recipe


def _mark(path: Path, info: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, path)


def _seed_from_shipped(shipped: Path, tdir: Path) -> None:
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


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


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


def run_recipe(recipe: dict, out: str | Path | None = None, progress: bool = True) -> Path:
    """Run (or resume) every stage of ``recipe``; returns the final model's directory."""
    import torch

    from jacobi_ext.models import load_model

    from .prompts import load_prompts
    from .trainer import TrainConfig, train
    from .trajectories import collect

    out = Path(out or recipe.get("out", "runs/distill"))
    device = check_device(recipe.get("device", "cpu"))  # collection's; training: accelerate's
    out.mkdir(parents=True, exist_ok=True)
    base = recipe.get("model") or None
    threads = recipe.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    pcfg = recipe.get("prompts", {})
    prompts = load_prompts(pcfg.get("source"), None)
    teacher = base
    for k, st in enumerate(recipe["stages"], 1):
        sdir = out / f"stage-{k}-{st.get('name', 'stage')}"
        tdir, rdir = sdir / "trajectories", sdir / "train"
        n = int(st["block_size"])
        # Collection: the base model for stage 1, the previous stage's model after that.
        if not (sdir / "COLLECTED").exists():
            t0 = time.perf_counter()
            if st.get("shipped_trajectories"):
                _seed_from_shipped(Path(st["shipped_trajectories"]), tdir)
            dtype = _dtype(st.get("collect_dtype", "float32"))
            model, tok = load_model(teacher, dtype=dtype, device=device)
            lo, hi = st.get("prompt_range", [0, len(prompts)])
            summary = collect(
                model, tok, prompts[lo:hi], tdir, block_size=n,
                max_new_tokens=int(st["max_new_tokens"]), teacher=str(teacher or "base"),
                max_prompt_tokens=pcfg.get("max_prompt_tokens"), progress=progress,
                fixed_points_only=bool(st.get("collect_fixed_points", False)),
                batch_size=int(st.get("collect_batch_size", 1)),
            )  # fmt: skip
            del model
            summary["wall_seconds"] = time.perf_counter() - t0
            _mark(sdir / "COLLECTED", summary)
            print(f"stage {k}: collected {summary}", flush=True)
        final = rdir / "final"
        if not (sdir / "TRAINED").exists():
            t0 = time.perf_counter()
            tcfg = dict(st.get("train", {}))
            tcfg.update(model=teacher, data=[str(tdir)], out=str(rdir))
            tcfg.setdefault("window", int(st.get("window", 16)))
            tcfg.setdefault("threads", threads)
            last = train(TrainConfig.from_dict(tcfg), progress=progress)
            last["wall_seconds"] = time.perf_counter() - t0
            if last.get("stopped_early"):  # a chunk of a long run: the same command goes on
                print(f"stage {k}: chunk ended at step {last.get('step')}; rerun to go on")
                return rdir
            _mark(sdir / "TRAINED", last)
            print(f"stage {k}: trained {last}", flush=True)
        teacher = str(final)
    link = out / "final"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(Path(teacher).resolve())
    return link
