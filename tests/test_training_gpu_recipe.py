"""The GPU recipe (recipes/smollm2_gpu.toml) and its driver (python_training/jobs/gpu_run.py),
dry-run on the CPU: the same recipe with a few overrides (device cpu, float32, a tiny random
Llama with SmolLM2's tokenizer, 6 prompts, 6 steps) runs every phase end to end into one folder;
a job whose time runs out, a crash mid-training and a chunk that ends early all go on when rerun;
a finished run's rerun changes nothing; the packed state (what a job brings back from the
machine) keeps to the part size and the limits asked for and continues on a "fresh machine"
(another folder). Also: the real recipe parses into valid settings, CUDA asked for without a GPU
is a clear error, and the job helpers' entry points (the command, ``python -m``, the setup
script's paths) lead to what exists."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from python_training.distill import load_recipe, run_recipe
from python_training.jobs import gpu_carry, gpu_run
from python_training.trainer import TrainConfig

ROOT = Path(__file__).parents[1]
GPU_RECIPE = ROOT / "python_training" / "recipes" / "smollm2_gpu.toml"
N_PROMPTS, STEPS = 6, 6


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's own tokenizer (vocab 49152, from the GGUF that is
    installed with the package: no download), saved like a checkpoint."""
    from transformers import AutoTokenizer

    from jacobi_ext.models import default_model_file, tiny_llama

    path = default_model_file()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = tiny_llama(vocab_size=len(tok), eos_token_id=tok.eos_token_id, seed=1)
    model.generation_config.eos_token_id = tok.eos_token_id
    d = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def dry_recipe(model: Path, **extra: str) -> dict:
    """The GPU recipe with the CPU dry-run's overrides, applied as `--set` would."""
    recipe = load_recipe(GPU_RECIPE)
    sets = {
        "model": str(model), "device": "cpu", "threads": "1",
        "stages.0.collect_dtype": "float32", "stages.0.prompt_range": f"[0, {N_PROMPTS}]",
        "stages.0.max_new_tokens": "32", "stages.0.collect_batch_size": "2",
        "stages.0.train.max_steps": str(STEPS), "stages.0.train.save_every": "2",
        "stages.0.train.snapshot_every": "3", "stages.0.train.mixed_precision": "no",
        "eval.dtype": "float32", "eval.max_new_tokens": "16", "eval.curve_prompts": "1",
        "eval.humaneval_limit": "3", "run.humaneval_slice": "2", "run.collect_chunk_batches": "1",
        "run.train_load_seconds": "0", "run.min_train_seconds": "0", "run.reserve_seconds": "0",
        **extra,
    }  # fmt: skip
    for k, v in sets.items():
        gpu_run.set_key(recipe, f"{k}={v}")
    return recipe


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def tree_digest(out: Path) -> dict[str, str]:
    """Content hash of every file a rerun must not touch (its own call log and summary aside)."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in ("calls.jsonl", "summary.json")
    }


def test_gpu_recipe_is_valid_and_sized_for_one_gpu():
    recipe = gpu_run.check_recipe(load_recipe(GPU_RECIPE))
    st = recipe["stages"][0]
    assert recipe["device"] == "cuda" and st["collect_dtype"] == "bfloat16"
    assert st["collect_fixed_points"] and st["collect_batch_size"] >= 64
    assert st["max_new_tokens"] % st["block_size"] == 0
    tr = st["train"]
    # What the driver adds to the stage's settings must make a valid TrainConfig too.
    cfg = TrainConfig.from_dict({**tr, "model": None, "data": ["x"], "out": "y", "cpu": False,
                                 "stop_after_minutes": 8.0})  # fmt: skip
    assert cfg.lora_rank == 16 and cfg.mixed_precision == "bf16"
    assert (cfg.variant, cfg.synthetic_fraction, cfg.random_phase) == ("clean_context", 1.0, True)
    assert cfg.ar_weight == 1.0 and cfg.consistency_reduction == "mean"
    # ≥ 4 curve points: base, ≥ 2 snapshots, final.
    assert cfg.max_steps // cfg.snapshot_every >= 2 and cfg.max_steps % cfg.snapshot_every == 0
    ev = recipe["eval"]
    assert set(ev["humaneval_methods"]) <= {"ar", "jacobi", "multiblock", "greedy"}
    assert ev["max_new_tokens"] == 256 and ev["curve_prompts"] >= 8
    lo, hi = st["prompt_range"]
    assert hi - lo >= cfg.max_steps  # each training sequence a new prompt


def test_short_recipe_collects_nothing_and_starts_from_the_shipped_adapter():
    """recipes/smollm2_gpu_short.toml, the shortest GPU run, collects nothing: its prompt range
    is the shipped fixed points', and it trains on from the shipped adapter."""
    import gzip

    recipe = gpu_run.check_recipe(load_recipe(GPU_RECIPE.with_name("smollm2_gpu_short.toml")))
    st = recipe["stages"][0]
    tr = TrainConfig.from_dict({**st["train"], "model": None, "data": ["x"], "out": "y",
                                "cpu": False, "stop_after_minutes": 8.0})  # fmt: skip
    assert tr.restart_schedule and (ROOT / tr.init_adapter / "train_state.json").is_file()
    assert tr.max_steps <= 2500 and tr.max_steps % tr.snapshot_every == 0
    assert recipe["eval"]["dtype"] == "float32"  # comparable with the CPU curve, exact
    shipped = ROOT / st["shipped_trajectories"]
    ids = {json.loads(x)["id"] for f in shipped.glob("*.jsonl.gz") for x in gzip.open(f, "rt")}
    lo, hi = st["prompt_range"]
    assert len(ids) >= 0.98 * (hi - lo)  # (the rest are prompts too long to collect)
    base = json.loads((ROOT / tr.init_adapter / "train_state.json").read_text())["config"]
    for k in ("lora_rank", "variant", "window"):
        assert getattr(tr, k) == base[k], k  # the same adapter shape and training task


def test_gpu_run_command_exists(capsys):
    from jacobi_ext.apps.cli import main

    with pytest.raises(SystemExit) as e:
        main(["gpu-run", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for option in ("--minutes", "--pack", "--part-mib", "--max-files", "--max-total-mib"):
        assert option in out, option
    # `python -m python_training.jobs.gpu_run` (what gpu_setup.sh runs) takes the same options.
    with pytest.raises(SystemExit) as e:
        gpu_run.main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m python_training.jobs.gpu_run")


def test_setup_script_leads_to_the_job_helpers():
    """gpu_setup.sh finds the repository root from where it lies, runs gpu_carry.py as a file
    (nothing is installed yet) and gpu_run as a module: all of them where it says."""
    import importlib.util
    import re

    script = ROOT / "python_training" / "jobs" / "gpu_setup.sh"
    text = script.read_text()
    depth = len(script.relative_to(ROOT).parts) - 1
    up = "/".join([".."] * depth)
    assert f'ROOT="$(cd "$(dirname "${{BASH_SOURCE[0]}}")/{up}" && pwd)"' in text
    files = re.findall(r'"\$ROOT/([^"]+\.py)"', text)
    assert files == ["python_training/jobs/gpu_carry.py"]
    assert all((ROOT / f).is_file() for f in files)
    modules = re.findall(r" -m (python_training[\w.]*)", text)
    assert modules == ["python_training.jobs.gpu_run"]
    assert all(importlib.util.find_spec(m) for m in modules)


def test_unknown_driver_keys_and_bad_overrides_are_errors():
    recipe = load_recipe(GPU_RECIPE)
    recipe["eval"]["limit"] = 3
    with pytest.raises(ValueError, match=r"unknown \[eval\] settings: \['limit'\]"):
        gpu_run.check_recipe(recipe)
    recipe = load_recipe(GPU_RECIPE)
    recipe["eval"]["dtype"] = "fp8"
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        gpu_run.check_recipe(recipe)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        gpu_run.set_key(recipe, "device")
    r = load_recipe(GPU_RECIPE)
    gpu_run.set_key(r, "device=cpu")
    gpu_run.set_key(r, "stages.0.prompt_range=[0, 3]")
    gpu_run.set_key(r, "stages.0.train.lr=1e-3")
    assert r["device"] == "cpu" and r["stages"][0]["prompt_range"] == [0, 3]
    assert r["stages"][0]["train"]["lr"] == 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="asks for device 'cuda'.*sees no CUDA device"):
        gpu_run.run(load_recipe(GPU_RECIPE), out=tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    with pytest.raises(RuntimeError, match="sees no CUDA device"):  # distill: the same check
        run_recipe(load_recipe(GPU_RECIPE), out=tmp_path / "out2")


STAGE = "stage-1-n16"  # the GPU recipe's stage folder


def test_dry_run_every_phase_resumable(tiny_model, tmp_path, monkeypatch):
    """One run through every phase, job by job, as the steps below; each goes on from the last."""
    out, back = tmp_path / "run", tmp_path / "OUT"

    def recipe(**extra: str) -> dict:
        return dry_recipe(tiny_model, **extra)

    job_runs_out_of_time_in_collect(recipe, out, back)
    crashed = job_crashes_mid_training(recipe, out, back, tmp_path / "OUT-crashed", monkeypatch)
    chunk_ends_at_once(recipe, out)
    curve = next_job_goes_on_to_the_end(recipe, out, back)
    rerun_of_a_finished_run_changes_nothing(recipe, out)
    fresh_machine_restores_the_finished_run(recipe, out, back, tmp_path / "fresh", curve)
    fresh_machine_goes_on_after_the_crash(recipe, crashed, tmp_path / "fresh-after-crash")


def job_runs_out_of_time_in_collect(recipe, out: Path, back: Path) -> None:
    """A job whose time runs out after the first collect chunk (2 prompts): it stops there, says
    so, and packs what it has."""
    traj = out / STAGE / "trajectories" / "trajectories.jsonl"

    def clock():  # the budget is gone once the first chunk is written
        return 1e9 if traj.exists() and len(traj.read_text().splitlines()) >= 2 else 0.0

    s = gpu_run.run(recipe(), out=out, minutes=1, pack_dir=back, clock=clock)
    assert s["next"] == "collect" and len(lines(traj)) == 2
    assert "stopped" in lines(out / "calls.jsonl")[-1]


def job_crashes_mid_training(recipe, out: Path, back: Path, crashed: Path, monkeypatch) -> Path:
    """The next job collects the rest (no prompt twice), then training crashes at step 3; what
    it packed despite the crash is kept in ``crashed`` for a fresh machine."""
    from python_training import trainer

    real = trainer.example_at
    calls = {"n": 0}

    def crash_at_step_3(records, cfg, i):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated crash")
        return real(records, cfg, i)

    monkeypatch.setattr(trainer, "example_at", crash_at_step_3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        gpu_run.run(recipe(), out=out, pack_dir=back)
    monkeypatch.setattr(trainer, "example_at", real)
    ids = [r["id"] for r in lines(out / STAGE / "trajectories" / "trajectories.jsonl")]
    assert len(ids) == len(set(ids)) == N_PROMPTS
    assert (out / STAGE / "COLLECTED").exists()
    assert not (out / STAGE / "TRAINED").exists()
    state = out / STAGE / "train" / "adapter" / "train_state.json"
    assert json.loads(state.read_text())["step"] == 2
    summary = json.loads((back / "summary.json").read_text())  # packed despite the crash
    assert summary["next"] == "train" and summary["train"]["state"]["step"] == 2
    shutil.copytree(back, crashed)
    assert list(crashed.glob("state.tar.gz.*"))
    return crashed


def chunk_ends_at_once(recipe, out: Path) -> None:
    """A chunk that ends at once (stop_after_minutes ~ 0): stopped early, nothing lost."""
    s = gpu_run.run(recipe(**{"stages.0.train.stop_after_minutes": "1e-9"}), phases=("train",),
                    out=out)  # fmt: skip
    assert s["next"] == "train"
    assert "chunk ended at step 2" in lines(out / "calls.jsonl")[-1]["stopped"]


def next_job_goes_on_to_the_end(recipe, out: Path, back: Path) -> list[dict]:
    """The same command goes on: training from its checkpoint, then the evaluation; what comes
    back is a few files, each at most a part. Returns the curve's rows."""
    s = gpu_run.run(recipe(), out=out, pack_dir=back)
    assert s["next"] == "done"
    train_dir = out / STAGE / "train"
    assert [r["step"] for r in lines(train_dir / "log.jsonl")] == list(range(1, STEPS + 1))
    curve = lines(out / "eval" / "curve.jsonl")
    assert [c["label"] for c in curve] == ["base", f"{STAGE}/final", f"{STAGE}/step-3"]
    for c in curve:
        for key in ("humaneval/jacobi", "humaneval/multiblock", "code-heldout/jacobi"):
            assert c[key]["tpf"] >= 1.0 and c[key]["tokens"] > 0
    he = s["eval"]["humaneval_final"]
    assert set(he) == {"ar", "jacobi", "multiblock"} and he["ar"]["tasks"] == 3
    assert he["jacobi"]["identical_to_ar"] == 1.0  # fp32: lossless, token for token
    assert set(s["eval"]["humaneval_base"]) == {"ar"}
    assert s["eval"]["humaneval_base"]["ar"]["tasks"] == 3  # slices of 2: the last one short
    for f in ("curve.png", "training_curves.png", "EVALUATED"):
        assert (out / "eval" / f).exists()
    assert (train_dir / "adapter" / "adapter_model.safetensors").exists()
    assert s["seconds_per_phase"].keys() == {"collect", "train", "eval"}
    # What comes back: a few files, each at most a part (15 MiB by default), summary readable
    # as is.
    files = sorted(back.iterdir())
    assert len(files) <= 8 and all(f.stat().st_size <= 15 * 2**20 for f in files)
    assert {"summary.json", "curve.png"} <= {f.name for f in files}
    return curve


def rerun_of_a_finished_run_changes_nothing(recipe, out: Path) -> None:
    """Nothing new anywhere; and `jacobi-forcing distill` reads the same folder: its one stage
    done, final linked."""
    before = tree_digest(out)
    s = gpu_run.run(recipe(), out=out)
    assert s["next"] == "done" and tree_digest(out) == before
    assert all("nothing" in c.get("did", "") for c in lines(out / "calls.jsonl")[-3:])
    final = run_recipe(recipe(), out=out, progress=False)
    assert final.resolve() == out / STAGE / "train" / "final"
    assert (final / "model.safetensors").exists()


def fresh_machine_restores_the_finished_run(recipe, out: Path, back: Path, fresh: Path,
                                            curve: list[dict]) -> None:  # fmt: skip
    """The finished run's parts restore, and the merged model is rebuilt from the adapter (the
    pack leaves it out) equal to the trained one; the curve is carried over, not measured
    again."""
    from safetensors.torch import load_file

    s = gpu_run.run(recipe(), out=fresh, restore_dir=back)
    assert s["next"] == "done"
    a = load_file(out / STAGE / "train" / "final" / "model.safetensors")
    b = load_file(fresh / STAGE / "train" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert lines(fresh / "eval" / "curve.jsonl") == curve


def fresh_machine_goes_on_after_the_crash(recipe, crashed: Path, fresh: Path) -> None:
    """With the crashed job's parts, training goes on from the adapter's train_state.json (no
    checkpoint came along) to the end, its log continued."""
    s = gpu_run.run(recipe(), phases=("train",), out=fresh, restore_dir=crashed)
    assert s["next"] == "eval" and s["train"]["state"]["step"] == STEPS
    log = lines(fresh / STAGE / "train" / "log.jsonl")
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))


def test_pack_limits_and_round_trip(tmp_path):
    src = tmp_path / "src"
    (src / "a" / "checkpoints").mkdir(parents=True)
    (src / "a" / "checkpoints" / "big.bin").write_bytes(b"x" * 1000)
    (src / "a" / "keep.bin").write_bytes(torch.randint(0, 255, (300_000,)).byte().numpy().tobytes())
    (src / "summary.json").write_text("{}")
    dest = tmp_path / "OUT"
    files = gpu_run.pack_results(src, dest, part_mib=0.1, max_files=8, max_total_mib=1)
    parts = sorted(dest.glob("state.tar.gz.*"))
    assert len(parts) >= 3 and all(p.stat().st_size <= 0.1 * 2**20 for p in parts)
    assert set(files) == {*parts, dest / "summary.json"}
    # No limit by default.
    assert len(gpu_run.pack_results(src, tmp_path / "OUT1", part_mib=0.02)) > 8
    back = tmp_path / "back"
    assert gpu_run.restore_results(dest, back)
    assert (back / "a" / "keep.bin").read_bytes() == (src / "a" / "keep.bin").read_bytes()
    assert not (back / "a" / "checkpoints").exists()
    with pytest.raises(RuntimeError, match="over the limit set for the results"):
        gpu_run.pack_results(src, tmp_path / "OUT2", part_mib=0.02, max_files=8)
    with pytest.raises(RuntimeError, match="max_total_mib 0.1"):
        gpu_run.pack_results(src, tmp_path / "OUT3", part_mib=0.1, max_total_mib=0.1)


def _wheel(dest: Path, name: str, payload: bytes) -> Path:
    """A minimal valid pure-Python wheel holding one data file."""
    path = dest / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    files = {
        f"{name}/__init__.py": b"",
        f"{name}/blob.bin": payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
        z.writestr(f"{info}/RECORD", record)
    return path


def test_wheelhouse_parts_assemble_only_when_complete(tmp_path):
    """Wheels cut into parts of a given size; the machine installs each wheel once all its
    pieces arrived (job by job), checked by sha256."""
    src = tmp_path / "wheels"
    src.mkdir()
    big = torch.randint(0, 255, (250_000,)).byte().numpy().tobytes()  # incompressible
    wheels = [_wheel(src, "smallpkg", b"s"), _wheel(src, "bigpkg", big)]
    parts = gpu_carry.split_into_parts(wheels, tmp_path / "parts", 100_000)
    assert [p.name for p in parts] == [f"p{i}" for i in range(1, len(parts) + 1)]
    assert len(parts) >= 3
    for p in parts:
        assert sum(f.stat().st_size for f in p.iterdir() if f.name != "MANIFEST.json") <= 100_000
    stash, site = tmp_path / "stash", tmp_path / "site"
    stash.mkdir()
    for f in parts[0].iterdir():  # the first job
        shutil.copy(f, stash)
    res = gpu_carry.assemble(stash, site)
    assert res["installed"] == ["smallpkg-0.1-py3-none-any.whl"]
    assert res["missing"] == [p.name for p in parts[1:]]
    for p in parts[1:]:  # the later jobs
        for f in p.iterdir():
            shutil.copy(f, stash)
    res = gpu_carry.assemble(stash, site)
    assert res["missing"] == [] and len(res["installed"]) == 2
    assert (site / "bigpkg" / "blob.bin").read_bytes() == big
    # With a wheelhouse, each whole wheel is kept there too (pip --no-index --find-links).
    house = tmp_path / "house"
    res = gpu_carry.assemble(stash, tmp_path / "site2", house)
    assert sorted(p.name for p in house.iterdir()) == sorted(w.name for w in wheels)
    assert (house / wheels[1].name).read_bytes() == wheels[1].read_bytes()
    # A damaged piece is refused, not installed.
    (site / ".installed-bigpkg-0.1-py3-none-any.whl").unlink()
    piece = next(stash.glob("bigpkg-*.001"))
    piece.write_bytes(b"0" + piece.read_bytes()[1:])
    with pytest.raises(ValueError, match="sha256"):
        gpu_carry.assemble(stash, site)
