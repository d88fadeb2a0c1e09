"""One short run of a one-stage distillation recipe on a GPU machine: collect, train and evaluate
as jobs with a time limit (``--minutes``), each resumable, everything in one output folder
(``recipes/smollm2_gpu.toml``; docs/training.md "On a GPU machine" has the jobs step by step).

    python -m python_training.jobs.gpu_run --recipe R.toml --phase all --minutes 9 --pack "$OUT"

($OUT: the job's output folder, what comes back from the machine.) A job runs the phases it is
given until its time is spent and stops at a safe point; the same command goes on from there:
collection by prompt id (in chunks of batches), training in chunks (``stop_after_minutes`` +
checkpoints), evaluation by the rows already in its JSONL files.

It builds on ``distill``'s stage helpers (``stage_dir``, ``collect_settings``,
``train_settings``, ``mark_done``) and ``distill_report``'s curve, so the output folder has
``distill.py``'s layout and ``distill`` and ``distill-report`` read it too::

    stage-1-<name>/trajectories/   collection; COLLECTED once every prompt is done
    stage-1-<name>/train/          log.jsonl, checkpoints/, snapshots/, adapter/ (LoRA +
                                   train_state.json), final/ (merged); TRAINED
    eval/                          curve.jsonl, curve.png, training_curves.png,
                                   humaneval_final.jsonl, humaneval_base.jsonl; EVALUATED
    calls.jsonl, summary.json      what each job did per phase and its seconds; the results so far

``--pack DIR`` writes the results to take away from the machine into DIR (e.g. the job's output
folder): summary.json, the curve's PNG and ``state.tar.gz.NNN``: the folder without checkpoints,
snapshots and the merged model, cut into parts of ``--part-mib`` (default 15 MiB); where the job's
output is limited, ``--max-files`` / ``--max-total-mib`` make the pack refuse to go over (default:
no limit). ``--restore DIR`` unpacks such parts into an output folder that has no run yet (a
fresh machine); training then goes on from the adapter's train_state.json (its optimizer moments
restart), and the merged model is rebuilt from it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from ..distill import (
    check_device,
    collect_settings,
    load_recipe,
    mark_done,
    parse_dtype,
    seed_from_shipped,
    stage_dir,
    train_settings,
)
from ..distill_report import (
    append_row,
    heldout_tpf,
    plot_scaling,
    plot_training,
    read_log,
    read_rows,
    scaling_points,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PHASES = ("collect", "train", "eval")
# The driver's settings, an optional [run] table: seconds kept at the end of a job for packing;
# prompts per collect() call (batches × collect_batch_size); the allowance for the trainer's
# model and data load (its own clock starts after it); the least training time worth a load;
# HumanEval problems per evaluate() call; the size of a state part; the most files and MiB the
# packed results may take (None: no limit).
RUN_DEFAULTS = dict(reserve_seconds=40.0, collect_chunk_batches=4, train_load_seconds=45.0,
                    min_train_seconds=60.0, humaneval_slice=8, part_mib=15.0, max_files=None,
                    max_total_mib=None)  # fmt: skip
EVAL_DEFAULTS = dict(dtype="float32", block_size=16, max_new_tokens=256, curve_prompts=16,
                     humaneval_limit=64, humaneval_methods=["ar", "jacobi", "multiblock"],
                     base_methods=["ar"])  # fmt: skip
PACK_EXCLUDE = ("checkpoints", "snapshots", "final")


class Budget:
    """Seconds left in this job; ``clock`` can be replaced, so tests end a budget on cue."""

    def __init__(self, minutes: float | None, clock=time.monotonic):
        self.clock = clock
        self.end = clock() + 60.0 * minutes if minutes else math.inf

    def left(self) -> float:
        return self.end - self.clock()


def check_recipe(recipe: dict) -> dict:
    """The recipe with its [run] and [eval] tables completed; errors for what this driver cannot
    run (unknown keys are errors, as in TrainConfig: a typo fails here, not mid-run)."""
    from ..trainer import TrainConfig

    if len(recipe["stages"]) != 1:
        raise ValueError("gpu_run runs one-stage recipes; use `jacobi-forcing distill` for more")
    st = recipe["stages"][0]
    if int(st["max_new_tokens"]) % int(st["block_size"]):
        raise ValueError(f"max_new_tokens {st['max_new_tokens']} is no multiple of block_size")
    for name, defaults in (("run", RUN_DEFAULTS), ("eval", EVAL_DEFAULTS)):
        unknown = set(recipe.get(name, {})) - set(defaults)
        if unknown:
            raise ValueError(f"unknown [{name}] settings: {sorted(unknown)}")
        recipe[name] = {**defaults, **recipe.get(name, {})}
    TrainConfig.from_dict(dict(st.get("train", {})))
    parse_dtype(st.get("collect_dtype", "float32")), parse_dtype(recipe["eval"]["dtype"])
    return recipe


def set_key(recipe: dict, assignment: str) -> None:
    """Apply ``--set stages.0.train.max_steps=4`` (a TOML value; a bare word is a string)."""
    key, sep, raw = assignment.partition("=")
    if not sep:
        raise ValueError(f"--set needs KEY=VALUE, got {assignment!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    node, parts = recipe, key.split(".")
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    node[parts[-1]] = value


class Run:
    def __init__(self, recipe: dict, out: Path, budget: Budget, progress: bool = False):
        self.recipe, self.out, self.budget, self.progress = recipe, Path(out), budget, progress
        self.device = check_device(recipe.get("device", "cpu"))
        self.stage, self.cfg, self.ev = recipe["stages"][0], recipe["run"], recipe["eval"]
        self.sdir = stage_dir(self.out, 1, self.stage)
        self.tdir, self.rdir = self.sdir / "trajectories", self.sdir / "train"
        self.edir = self.out / "eval"
        self.teacher = recipe.get("model") or None

    def time_for(self, seconds: float) -> bool:
        return self.budget.left() >= self.cfg["reserve_seconds"] + seconds

    def say(self, msg: str) -> None:
        print(f"[gpu_run {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    # ---- collect ---------------------------------------------------------------------------
    def collect(self) -> dict:
        from jacobi_ext.models import load_model

        from ..prompts import load_prompts
        from ..trajectories import collect, read_trajectories

        st = self.stage
        if (self.sdir / "COLLECTED").exists():
            return {"done": True, "did": "nothing (collected already)"}
        if not self.time_for(0):
            return {"stopped": "no time left in this job"}
        if st.get("shipped_trajectories"):
            seed_from_shipped(Path(st["shipped_trajectories"]), self.tdir)
        lo, hi = st.get("prompt_range", [0, None])
        prompts = load_prompts(self.recipe.get("prompts", {}).get("source"))[lo:hi]
        done = {r["id"] for r in read_trajectories(self.tdir)} if self.tdir.exists() else set()
        todo = [p for p in prompts if p.id not in done]
        settings = collect_settings(self.recipe, st, self.teacher, self.progress)
        chunk = settings["batch_size"] * int(self.cfg["collect_chunk_batches"])
        dtype = parse_dtype(st.get("collect_dtype", "float32"))
        model, tok = load_model(self.teacher, dtype=dtype, device=self.device)
        total = {"collected": 0, "tokens": 0, "skipped_long": 0, "seconds": 0.0}
        last = 0.0
        for i in range(0, len(todo), chunk):
            if not self.time_for(1.2 * last):
                return {**total, "stopped": f"budget spent; {len(todo) - i} prompts left"}
            t0 = time.perf_counter()
            s = collect(model, tok, todo[i : i + chunk], self.tdir, **settings)
            last = time.perf_counter() - t0
            for k in ("collected", "tokens", "skipped_long"):
                total[k] += s[k]
            total["seconds"] += last
            self.say(f"collect: {i + len(todo[i : i + chunk])}/{len(todo)} prompts, "
                     f"{total['tokens'] / max(total['seconds'], 1e-9):.0f} tok/s")  # fmt: skip
        total["records"] = len(read_trajectories(self.tdir))
        mark_done(self.sdir / "COLLECTED", total)
        return {**total, "done": True}

    # ---- train -----------------------------------------------------------------------------
    def train(self) -> dict:
        import torch

        from ..trainer import TrainConfig, latest_checkpoint, train

        if (self.sdir / "TRAINED").exists():
            if not (self.rdir / "final" / "model.safetensors").exists():
                self._rebuild_final()
            return {"done": True, "did": "nothing (trained already)"}
        if not (self.sdir / "COLLECTED").exists():
            return {"waiting": "collect first"}
        left = self.budget.left() - self.cfg["reserve_seconds"] - self.cfg["train_load_seconds"]
        if left < self.cfg["min_train_seconds"]:
            return {"stopped": f"{left:.0f} s left for training: too little for a chunk"}
        tcfg = train_settings(self.recipe, self.stage, self.teacher, self.sdir)
        tcfg["cpu"] = torch.device(self.device).type == "cpu"
        chunk = min(tcfg.get("stop_after_minutes") or math.inf, left / 60)
        tcfg["stop_after_minutes"] = chunk if math.isfinite(chunk) else None
        last = train(TrainConfig.from_dict(tcfg), progress=self.progress)
        if last.get("stopped_early"):  # (``last`` is empty when this chunk made no step)
            ck = latest_checkpoint(self.rdir)
            step = int(ck.name.split("-")[1]) if ck else 0
            return {"stopped": f"chunk ended at step {step}", "last": last}
        mark_done(self.sdir / "TRAINED", last)
        return {"done": True, "last": last}

    def _rebuild_final(self) -> None:
        """A restored run has the adapter, not the merged model (too big to pack): merge."""
        from jacobi_ext.models import load_model

        model, tok = load_model(self.rdir / "adapter")
        model.save_pretrained(self.rdir / "final", safe_serialization=True)
        tok.save_pretrained(self.rdir / "final")
        self.say("train: merged final/ rebuilt from the restored adapter")

    # ---- eval ------------------------------------------------------------------------------
    def eval(self) -> dict:
        if (self.edir / "EVALUATED").exists():
            return {"done": True, "did": "nothing (evaluated already)"}
        if not (self.sdir / "TRAINED").exists():
            return {"waiting": "train first"}
        if not (self.rdir / "final" / "model.safetensors").exists():
            self._rebuild_final()
        self.edir.mkdir(parents=True, exist_ok=True)
        points = scaling_points(self.out)
        final = next(p for p in points if p["label"].endswith("/final"))
        # The headline first (base and final), the middle of the curve last.
        units = [("curve", points[0]), ("curve", final), ("humaneval", final, "final"),
                 ("humaneval", points[0], "base")]  # fmt: skip
        units += [("curve", p) for p in points[1:] if p is not final]
        # Seconds of the last curve point / HumanEval slice of this job; until one was timed, a
        # guess for the GPU recipe's sizes (unmeasured), so a job does not start one it cannot
        # finish.
        took = {"curve": 60.0, "slice": 30.0} if self.device != "cpu" else {}
        loaded: list = [None, None]  # (model key, (model, tokenizer)): one model at a time
        try:
            for unit in units:
                if unit[0] == "curve":
                    if not self.time_for(took.get("curve", 0.0)):
                        return {"stopped": f"budget spent before curve point {unit[1]['label']}"}
                    self._curve_point(unit[1], loaded, took)
                elif not self._humaneval(unit[1], unit[2], loaded, took):
                    return {"stopped": f"budget spent in humaneval {unit[2]}"}
        finally:
            rows = read_rows(self.edir / "curve.jsonl")
            if rows:
                plot_scaling(rows, self.edir / "curve.png")
            plot_training(self.out, self.edir / "training_curves.png")
        mark_done(self.edir / "EVALUATED", {"curve_points": len(rows)})
        return {"done": True, "curve_points": len(rows)}

    def _model(self, point: dict, loaded: list):
        import torch

        from jacobi_ext.models import load_model

        key = point["model"] or "base"
        if loaded[0] != key:
            loaded[0] = loaded[1] = None
            if torch.device(self.device).type == "cuda":
                torch.cuda.empty_cache()
            dtype = parse_dtype(self.ev["dtype"])
            loaded[1] = load_model(point["model"] or self.teacher, dtype=dtype, device=self.device)
            loaded[0] = key
        return loaded[1]

    def _curve_point(self, point: dict, loaded: list, took: dict) -> None:
        path = self.edir / "curve.jsonl"
        if point["label"] in {r["label"] for r in read_rows(path)}:
            return
        t0 = time.perf_counter()
        model, tok = self._model(point, loaded)
        ev = self.ev
        res = heldout_tpf(model, tok, int(ev["curve_prompts"]), int(ev["max_new_tokens"]),
                          int(ev["block_size"]))  # fmt: skip
        took["curve"] = time.perf_counter() - t0
        row = dict(point, **res, prompts=int(ev["curve_prompts"]), dtype=ev["dtype"],
                   max_new_tokens=int(ev["max_new_tokens"]), block_size=int(ev["block_size"]),
                   device=self.device, seconds=round(took["curve"], 1))  # fmt: skip
        append_row(path, row)
        self.say(f"curve: {point['label']}: " + ", ".join(
            f"{k} {v['tpf']:.2f}" for k, v in res.items() if isinstance(v, dict)))  # fmt: skip

    def _humaneval(self, point: dict, which: str, loaded: list, took: dict) -> bool:
        """HumanEval[:limit] in slices, the budget checked before each; False: budget spent."""
        from jacobi_ext.data import load_humaneval

        from ..evaluate import done_rows, evaluate

        ev = self.ev
        path = self.edir / f"humaneval_{which}.jsonl"
        methods = list(ev["humaneval_methods"] if which == "final" else ev["base_methods"])
        limit, step = int(ev["humaneval_limit"]), int(self.cfg["humaneval_slice"])
        tasks = [p["task_id"] for p in load_humaneval(limit)]
        for off in range(0, len(tasks), step):
            done = done_rows(path)
            if all((t, m) in done for t in tasks[off : off + step] for m in methods):
                continue
            if not self.time_for(took.get("slice", 0.0)):
                return False
            t0 = time.perf_counter()
            model, tok = self._model(point, loaded)
            n = min(step, len(tasks) - off)
            evaluate(model, tok, path, methods=methods, limit=n, offset=off,
                     max_new_tokens=int(ev["max_new_tokens"]), block_size=int(ev["block_size"]),
                     label=which, progress=self.progress)  # fmt: skip
            took["slice"] = time.perf_counter() - t0
            self.say(f"humaneval {which}: {min(off + step, len(tasks))}/{len(tasks)} problems")
        return True


# ---- summary; the results packed to take away and restored on a fresh machine --------------
def humaneval_table(path: Path) -> dict:
    """evaluate.summarize per method, plus: tokens/s against our AR on the same tasks and the
    fraction of tasks whose tokens equal AR's (decoding is lossless; in bf16 rounding may part
    near-ties, so the eval runs in float32 by default)."""
    from ..evaluate import summarize

    if not path.exists() or not path.read_text().strip():
        return {}
    out = summarize(path)
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    ar = {r["task_id"]: r for r in rows if r["method"] == "ar"}
    for m, s in out.items():
        mine = [r for r in rows if r["method"] == m and r["task_id"] in ar]
        if m == "ar" or not mine:
            continue
        s["identical_to_ar"] = sum(r["token_ids"] == ar[r["task_id"]]["token_ids"]
                                   for r in mine) / len(mine)  # fmt: skip
        ts = [ar[r["task_id"]] for r in mine]
        a = sum(r["tokens"] for r in mine) / max(sum(r["seconds"] for r in mine), 1e-9)
        s["speedup_vs_ar"] = a / (sum(r["tokens"] for r in ts) / max(sum(r["seconds"] for r in ts),
                                                                     1e-9))  # fmt: skip
    return out


def summarize_run(run: Run) -> dict:
    def marker(p: Path):
        return json.loads(p.read_text()) if p.exists() else None

    state = run.rdir / "adapter" / "train_state.json"
    log = read_log(run.rdir / "log.jsonl") if (run.rdir / "log.jsonl").exists() else []
    calls = read_rows(run.out / "calls.jsonl")
    seconds: dict[str, float] = {}
    for c in calls:
        seconds[c["phase"]] = seconds.get(c["phase"], 0.0) + c["wall_seconds"]
    done = {"collect": run.sdir / "COLLECTED", "train": run.sdir / "TRAINED",
            "eval": run.edir / "EVALUATED"}  # fmt: skip
    curve = [{k: (v["tpf"] if isinstance(v, dict) else v) for k, v in r.items()
              if k in ("label", "tokens", "examples") or isinstance(v, dict)}
             for r in read_rows(run.edir / "curve.jsonl")]  # fmt: skip
    return {
        "next": next((p for p in PHASES if not done[p].exists()), "done"),
        "device": run.device,
        "collect": marker(done["collect"]),
        "train": {"state": {k: v for k, v in marker(state).items() if k != "config"}
                  if state.exists() else None, "last_log": log[-1] if log else None},
        "eval": {"curve": curve,
                 "humaneval_final": humaneval_table(run.edir / "humaneval_final.jsonl"),
                 "humaneval_base": humaneval_table(run.edir / "humaneval_base.jsonl")},
        "seconds_per_phase": {k: round(v, 1) for k, v in seconds.items()},
        "calls": calls,
    }  # fmt: skip


def pack_results(out: Path, dest: Path, part_mib: float = 15.0, max_files: int | None = None,
                 max_total_mib: float | None = None) -> list[Path]:  # fmt: skip
    """A run's results to take away: summary.json, the curve's PNG and the run's state as a tar
    in parts of ``part_mib`` (``state.tar.gz.NNN``, see PACK_EXCLUDE) into ``dest`` (e.g. the
    job's output folder); over ``max_files`` files or ``max_total_mib`` MiB (where the job's
    output is limited; None: no limit) it raises rather than lose files silently."""
    import shutil

    from .gpu_carry import pack_tree

    files = []
    dest.mkdir(parents=True, exist_ok=True)
    for f in (out / "summary.json", out / "eval" / "curve.png"):
        if f.exists():
            files.append(Path(shutil.copy(f, dest / f.name)))

    def skip(rel: Path) -> bool:
        return bool(set(rel.parts) & set(PACK_EXCLUDE)) or rel.name.endswith((".tmp", ".old"))

    files += pack_tree(out, dest, int(part_mib * 2**20), skip)
    total = sum(f.stat().st_size for f in files) / 2**20
    if (max_files is not None and len(files) > max_files) or (
        max_total_mib is not None and total > max_total_mib
    ):
        raise RuntimeError(
            f"the packed run is {len(files)} files, {total:.1f} MiB: over the limit set for the "
            f"results (max_files {max_files}, max_total_mib {max_total_mib}; larger --part-mib "
            "parts make fewer files)"
        )
    return files


def restore_results(src: Path, out: Path) -> bool:
    """Unpack the state ``pack_results`` wrote into ``src`` into ``out``, unless ``out``
    already holds a run (on a machine that kept its disk, that state is newer than any packed
    copy of it)."""
    from .gpu_carry import unpack_tree

    if any(Path(out).glob("stage-*")):
        return False
    return unpack_tree(src, out)


# ---- the command -----------------------------------------------------------------------------
def run(recipe: dict, phases=PHASES, out=None, minutes=None, pack_dir=None, restore_dir=None,
        progress: bool = False, clock=time.monotonic) -> dict:  # fmt: skip
    """Run (or go on with) ``phases`` within ``minutes``; returns the run's summary."""
    recipe = check_recipe(recipe)
    r = Run(recipe, Path(out or recipe.get("out", "runs/gpu")), Budget(minutes, clock), progress)
    r.out.mkdir(parents=True, exist_ok=True)
    if restore_dir and restore_results(Path(restore_dir), r.out):
        r.say(f"restored the run from {restore_dir}")
    try:
        run_phases(r, phases)
    finally:  # a crashed or stopped job still leaves its summary and packs what it has
        summary = summarize_run(r)
        (r.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        if pack_dir:
            rc = recipe["run"]
            pack_results(r.out, Path(pack_dir), rc["part_mib"], rc["max_files"],
                         rc["max_total_mib"])  # fmt: skip
    r.say(f"next: {summary['next']}")
    return summary


def run_phases(r: Run, phases) -> None:
    """Each phase in turn, logged to calls.jsonl, until one is not done (stopped by the budget
    or waiting for an earlier phase)."""
    for ph in phases:
        t0 = time.perf_counter()
        res = getattr(r, ph)()
        row = {"phase": ph, "at": time.strftime("%Y-%m-%d %H:%M:%S"),
               **res, "wall_seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        append_row(r.out / "calls.jsonl", row)
        r.say(f"{ph}: {json.dumps({k: v for k, v in res.items() if k != 'last'})}")
        if not res.get("done"):
            break


def add_parser(sub) -> None:
    p = sub.add_parser(
        "gpu-run",
        help="a one-stage recipe on one GPU as jobs with a time limit: collect, train, eval "
        "(resumable; one output folder; see docs/training.md 'On a GPU machine')",
    )
    p.add_argument("--recipe", required=True, help="TOML recipe (recipes/smollm2_gpu.toml)")
    p.add_argument("--phase", default="all", choices=[*PHASES, "all"])
    p.add_argument("--out", default=None, help="the output folder (default: the recipe's out)")
    p.add_argument(
        "--minutes", type=float, default=9.0,
        help="this job's time limit, packing included (default 9)",
    )  # fmt: skip
    p.add_argument(
        "--pack", default=None, metavar="DIR",
        help="write summary.json, the curve and the run's state in parts here (e.g. the job's "
        "output folder)",
    )  # fmt: skip
    p.add_argument(
        "--part-mib", type=float, default=None,
        help="the size of a state part (default: the recipe's [run] part_mib, else 15)",
    )  # fmt: skip
    p.add_argument(
        "--max-files", type=int, default=None,
        help="refuse a pack of more files (default: the recipe's [run] max_files, else no limit)",
    )  # fmt: skip
    p.add_argument(
        "--max-total-mib", type=float, default=None,
        help="refuse a pack of more MiB (default: the recipe's [run] max_total_mib, else no limit)",
    )  # fmt: skip
    p.add_argument("--restore", default=None, help="unpack a packed state from here first")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. device=cpu, stages.0.train.max_steps=4",
    )
    p.add_argument("--progress", action="store_true", help="progress bars (default: off)")
    p.set_defaults(handler=_cmd)


def _cmd(args) -> int:
    recipe = load_recipe(args.recipe)
    for a in args.set:
        set_key(recipe, a)
    for key in ("part_mib", "max_files", "max_total_mib"):
        if getattr(args, key) is not None:
            recipe.setdefault("run", {})[key] = getattr(args, key)
    phases = PHASES if args.phase == "all" else (args.phase,)
    run(recipe, phases, args.out, args.minutes, args.pack, args.restore, args.progress)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m python_training.jobs.gpu_run")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["gpu-run", *(sys.argv[1:] if argv is None else argv)])
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
