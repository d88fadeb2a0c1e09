"""The overfit proof and its ablations: does training on Jacobi states make plain Jacobi decoding
converge in fewer forwards, on the prompts it trained on?

A tiny randomly initialised Llama first memorises random answers to random prompts (AR loss
only, through the project's trainer: records whose blocks hold only their fixed point give no
consistency terms), so its greedy answers are arbitrary token strings and plain Jacobi decoding
of them takes ≈ 1 token per forward. Its greedy answers are then collected (the fixed points)
and it is trained with the Jacobi Forcing objective (packing + loss + trainer of this package)
under one setting; TPF of plain Jacobi (``generate(method="jacobi", lookup=False)``) on the same
prompts is measured before and after, and the tokens are checked against greedy AR.

    python -m python_training.overfit --steps 200 --set noise=fresh --set ar_weight=1 ...
    python -m python_training.overfit --grid     # the table of docs/results/overfit-2026-11-23

Everything is seeded: the same command gives the same numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .trajectories import make_record

EOS = 1  # the tiny model's EOS id (never in the prompts or the memorised answers)


@dataclass
class Task:
    prompts: list[list[int]]
    answers: list[list[int]]
    vocab: int
    n: int


def make_task(
    num_prompts: int = 4,
    prompt_len: int = 8,
    answer_len: int = 24,
    vocab: int = 128,
    n: int = 8,
    seed: int = 0,
) -> Task:
    """Random prompts and random answers (ids 2..vocab-1; 0 is PAD, 1 EOS): nothing in an
    answer is predictable from its own earlier tokens, only from the prompt and position."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]
    answers = [[rng.randrange(2, vocab) for _ in range(answer_len)] for _ in range(num_prompts)]
    return Task(prompts, answers, vocab, n)


def tiny_model(vocab: int = 128, hidden: int = 128, layers: int = 2, seed: int = 0):
    """A tiny Llama from LlamaConfig (random init), with the ``jacobi`` attention for training
    (outside a layout it is plain SDPA, so decoding uses the same model object)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import jacobi_ext  # noqa: F401  (registers attn_implementation="jacobi")

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=EOS,
        bos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="jacobi").eval()


def write_fixed_points(d: Path, prompts, answers, n: int) -> Path:
    """A trajectory directory whose blocks hold only their fixed point (``answers`` cut in
    n-token blocks): the AR-only data of the memorisation phase, and the data of synthetic
    noise."""
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "trajectories.jsonl", "w") as f:
        for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
            blocks = [[a[s : s + n]] for s in range(0, len(a), n)]
            f.write(json.dumps(make_record(f"p{i}", p, blocks, n, {EOS}, 0)) + "\n")
    return d


def jacobi_tpf(model, prompts, n: int, max_new_tokens: int) -> dict:
    """Plain Jacobi (one block of n, no lookup) on ``prompts``: TPF over all of them, and
    whether every answer equals greedy AR's."""
    from jacobi_ext.decoding import generate

    model.eval()
    new = fwd = 0
    identical = True
    answers = []
    for p in prompts:
        ids = torch.tensor([p])
        ar = generate(model, ids, method="ar", max_new_tokens=max_new_tokens)
        jr = generate(
            model, ids, method="jacobi", block_size=n, lookup=False, max_new_tokens=max_new_tokens
        )
        identical &= torch.equal(ar.tokens, jr.tokens)
        new, fwd = new + jr.new_tokens, fwd + jr.forwards
        answers.append(ar.tokens[0].tolist())
    return {"tpf": new / max(fwd, 1), "identical": identical, "answers": answers}


@dataclass
class Setting:
    """One training setting of the ablation (defaults: what learns fastest, see the README of
    docs/results/overfit-2026-11-23)."""

    noise: str = "fresh"  # fresh (synthetic, redrawn each packing) | fixed (collected states)
    ar_weight: float = 1.0
    consistency_reduction: str = "mean"
    lr: float = 3e-3
    variant: str = "clean_context"
    schedule: str = "linear"
    random_phase: bool = True
    window: int = 8
    max_noise_tokens: int | None = None
    steps: int = 200
    extra: dict = field(default_factory=dict)  # further TrainConfig fields

    def train_config(self, data: str, out: str, seed: int = 0):
        from .trainer import TrainConfig

        d = dict(
            data=[data], out=out, window=self.window, schedule=self.schedule,
            variant=self.variant, ar_weight=self.ar_weight,
            consistency_reduction=self.consistency_reduction, lr=self.lr, max_steps=self.steps,
            warmup_ratio=0.03, max_grad_norm=1.0, seed=seed,
            synthetic_fraction=1.0 if self.noise == "fresh" else 0.0,
            random_phase=self.random_phase, max_noise_tokens=self.max_noise_tokens,
        )  # fmt: skip
        d.update(self.extra)
        return TrainConfig.from_dict(d)


def memorise(model, task: Task, workdir: Path, steps: int = 300, lr: float = 3e-3) -> None:
    """Phase 1: AR-train ``model`` on the task's answers through the trainer (no noise)."""
    from .trainer import TrainConfig, train

    data = write_fixed_points(workdir / "answers", task.prompts, task.answers, task.n)
    cfg = TrainConfig(
        data=[str(data)], out=str(workdir / "memorise"), window=2, ar_weight=1.0, lr=lr,
        max_steps=steps, warmup_ratio=0.03, max_grad_norm=1.0, variant="clean_context",
    )  # fmt: skip
    train(cfg, model=model, progress=False)
    model.eval()


def collect_data(model, task: Task, workdir: Path, max_new_tokens: int, noise: str) -> Path:
    """The student's own greedy answers: fixed points only (fresh noise) or full Jacobi
    trajectories (fixed noise), through ``trajectories.collect``."""
    from .prompts import Prompt
    from .trajectories import collect

    d = workdir / f"data-{noise}"
    ps = [Prompt(f"p{i}", text="") for i in range(len(task.prompts))]
    collect(
        model, None, ps, d, block_size=task.n, max_new_tokens=max_new_tokens, progress=False,
        encode=lambda p: torch.tensor([task.prompts[int(p.id[1:])]]),
        fixed_points_only=noise == "fresh",
    )  # fmt: skip
    return d


def run(
    setting: Setting,
    task: Task | None = None,
    memorise_steps: int = 200,
    eval_every: int | None = None,
    seed: int = 0,
    hidden: int = 128,
    layers: int = 4,
    workdir: str | Path | None = None,
) -> dict:
    """Memorise, collect, JF-train under ``setting``, measure. Returns TPF before / after (and
    at every ``eval_every`` steps, from HF snapshots of the same run), identity with greedy, the
    final losses and the wall times."""
    from transformers import AutoModelForCausalLM

    from .trainer import train

    task = task or make_task(seed=seed)
    max_new = len(task.answers[0])
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory()
        workdir = tmp.name
    wd = Path(workdir)
    t0 = time.perf_counter()
    model = tiny_model(task.vocab, hidden=hidden, layers=layers, seed=seed)
    memorise(model, task, wd, steps=memorise_steps)
    base = jacobi_tpf(model, task.prompts, task.n, max_new)
    t1 = time.perf_counter()
    data = collect_data(model, task, wd, max_new, setting.noise)
    cfg = setting.train_config(str(data), str(wd / "jf"), seed=seed)
    if eval_every:
        cfg.snapshot_every = eval_every
    last = train(cfg, model=model, progress=False)
    t2 = time.perf_counter()
    after = jacobi_tpf(model, task.prompts, task.n, max_new)
    t3 = time.perf_counter()
    curve = []
    for st in range(eval_every, setting.steps, eval_every) if eval_every else []:
        snap = AutoModelForCausalLM.from_pretrained(
            wd / "jf" / "snapshots" / f"step-{st}", attn_implementation="sdpa"
        )
        curve.append((st, round(jacobi_tpf(snap, task.prompts, task.n, max_new)["tpf"], 3)))
    curve.append((setting.steps, round(after["tpf"], 3)))
    if tmp is not None:
        tmp.cleanup()
    return {
        "tpf_before": base["tpf"],
        "tpf_after": after["tpf"],
        "identical_before": base["identical"],
        "identical_after": after["identical"],
        "answers_kept": after["answers"] == base["answers"],
        "answers_memorised": sum(
            a == b for a, b in zip(base["answers"], task.answers, strict=True)
        ),
        "curve": curve,
        "ar": last.get("ar"),
        "consistency": last.get("consistency"),
        "seconds_memorise": round(t1 - t0, 1),
        "seconds_train": round(t2 - t1, 1),
        "seconds_eval": round(t3 - t2, 1),
        "model": model,
    }


def real_model_run(
    workdir: str | Path,
    num_prompts: int = 32,
    n: int = 16,
    max_new_tokens: int = 64,
    setting: Setting | None = None,
    eval_steps: tuple[int, ...] = (),
    model_name: str | None = None,
    progress: bool = False,
    base_prompts: int | None = None,
    heldout: int = 0,
) -> dict:
    """The same proof on a real model (default SmolLM2-135M-Instruct): the first
    ``num_prompts`` stdlib prompts, their greedy answers (fixed points, KV-cached AR), JF
    training with fresh synthetic noise, plain Jacobi TPF on those prompts before and after
    (and on the snapshots at ``eval_steps``). Resumable through ``workdir`` (collection by
    prompt, training from its checkpoints). ``base_prompts``: measure the base model on only
    that many of the prompts (its plain-Jacobi TPF is ≈ 1: slow to confirm on a CPU).
    ``heldout``: also plain Jacobi TPF on that many HumanEval problems, before and after (what
    training on 32 prompts does to prompts it never saw)."""
    from jacobi_ext.decoding import generate
    from jacobi_ext.models import load_model

    from .prompts import load_prompts
    from .trainer import train
    from .trajectories import collect

    wd = Path(workdir)
    setting = setting or Setting(lr=1e-4, window=16, steps=300)
    prompts = load_prompts(None, num_prompts)
    t0 = time.perf_counter()
    model, tok = load_model(model_name, dequantize=True)  # it is trained below: real weights
    # Batched (8 prompts a forward): collection must not dominate the proof's time.
    collect(model, tok, prompts, wd / "fixed_points", block_size=n, teacher="base",
            max_new_tokens=max_new_tokens, progress=progress, fixed_points_only=True,
            batch_size=8)  # fmt: skip
    t1 = time.perf_counter()
    ids = [p.input_ids(tok) for p in prompts]
    if heldout:
        from jacobi_ext.data import humaneval_input_ids, load_humaneval

        held = [humaneval_input_ids(tok, p) for p in load_humaneval(heldout)]

    def tpf(m, k=None, inputs=None) -> tuple[float, bool]:
        m.eval()
        new = fwd = 0
        same = True
        for x in (ids if inputs is None else inputs)[:k]:
            ar = generate(m, x, method="ar", max_new_tokens=max_new_tokens)
            jr = generate(m, x, method="jacobi", block_size=n, lookup=False,
                          max_new_tokens=max_new_tokens)  # fmt: skip
            same &= torch.equal(ar.tokens, jr.tokens)
            new, fwd = new + jr.new_tokens, fwd + jr.forwards
        return new / max(fwd, 1), same

    base = tpf(model, base_prompts)
    held_before = tpf(model, inputs=held) if heldout else (None, None)
    t2 = time.perf_counter()
    cfg = setting.train_config(str(wd / "fixed_points"), str(wd / "train"))
    cfg.save_every = 50
    cfg.snapshot_every = min(eval_steps) if eval_steps else 0
    last = train(cfg, model=model, tokenizer=tok, progress=progress)
    t3 = time.perf_counter()
    after = tpf(model)
    held_after = tpf(model, inputs=held) if heldout else (None, None)
    t4 = time.perf_counter()
    curve = []
    for st in eval_steps:
        snap = wd / "train" / "snapshots" / f"step-{st}"
        if st < setting.steps and (snap / "model.safetensors").exists():
            curve.append((st, round(tpf(load_model(snap)[0])[0], 3)))
    return {
        "tpf_before": base[0], "identical_before": base[1],
        "tpf_after": after[0], "identical_after": after[1], "curve": curve,
        "heldout_problems": heldout, "heldout_tpf_before": held_before[0],
        "heldout_tpf_after": held_after[0],
        "heldout_identical": bool(held_before[1] and held_after[1]) if heldout else None,
        "artifact_bytes": _artifact_bytes(wd / "train"),
        "ar": last.get("ar"), "consistency": last.get("consistency"),
        "seconds_collect": round(t1 - t0, 1), "seconds_eval_before": round(t2 - t1, 1),
        "seconds_train": round(t3 - t2, 1), "seconds_eval_after": round(t4 - t3, 1),
    }  # fmt: skip


def _artifact_bytes(train_dir: Path) -> int | None:
    """What a run ships: the LoRA adapter's safetensors, else the full model's."""
    for f in ("adapter/adapter_model.safetensors", "final/model.safetensors"):
        if (train_dir / f).is_file():
            return (train_dir / f).stat().st_size
    return None


GRID = {  # name -> overrides of the default Setting (the README table)
    "default (fresh, clean_ctx, λ=1, mean, random phase)": {},
    "fixed trajectories (collected states, fixed saw-tooth)": {
        "noise": "fixed",
        "random_phase": False,
    },
    "fixed trajectories, random phase": {"noise": "fixed"},
    "noisy_context mask": {"variant": "noisy_context"},
    "λ=10, mean/T (docs/method.md §3)": {"ar_weight": 10.0, "consistency_reduction": "mean_div_T"},
    "λ=10, mean": {"ar_weight": 10.0},
    "λ=1, mean/T": {"consistency_reduction": "mean_div_T"},
    "no random phase (linear saw-tooth)": {"random_phase": False},
    "random schedule": {"schedule": "random", "random_phase": False},
    "k ≤ n-1 (first token kept)": {"max_noise_tokens": 7},
    "lr 1e-3": {"lr": 1e-3},
    "lr 1e-2": {"lr": 1e-2},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], help="Setting field=value")
    ap.add_argument("--grid", action="store_true", help="every row of GRID")
    ap.add_argument("--only", nargs="*", default=None, help="grid rows whose name contains any")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--answer-len", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="append JSON lines here")
    ap.add_argument(
        "--real", default=None, metavar="DIR",
        help="run the real-model proof (SmolLM2, --prompts prompts, n=--block-size) in DIR",
    )  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=64, help="--real only")
    ap.add_argument("--eval-steps", type=int, nargs="*", default=[], help="--real only")
    ap.add_argument("--base-prompts", type=int, default=None, help="--real only")
    ap.add_argument("--heldout", type=int, default=0, help="--real only: HumanEval problems")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.real:
        kw = {"lr": 1e-4, "window": 16}
        for s in a.set:
            k, v = s.split("=", 1)
            try:
                kw[k] = json.loads(v)
            except json.JSONDecodeError:
                kw[k] = v
        kw["steps"] = a.steps
        r = real_model_run(a.real, a.prompts, a.block_size, a.max_new_tokens, Setting(**kw),
                           tuple(a.eval_steps), progress=True,
                           base_prompts=a.base_prompts, heldout=a.heldout)  # fmt: skip
        print(json.dumps({**kw, **r}), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps({**kw, **r}) + "\n")
        return 0
    rows = GRID if a.grid else {"custom": {}}
    if a.only:
        rows = {k: v for k, v in rows.items() if any(s in k for s in a.only)}
    for name, over in rows.items():
        kw = dict(over)
        for s in a.set:
            k, v = s.split("=", 1)
            try:
                kw[k] = json.loads(v)
            except json.JSONDecodeError:
                kw[k] = v
        kw["steps"] = a.steps
        task = make_task(a.prompts, answer_len=a.answer_len, n=a.block_size, seed=a.seed)
        r = run(Setting(**kw), task, eval_every=a.eval_every, seed=a.seed, hidden=a.hidden,
                layers=a.layers)  # fmt: skip
        r.pop("model")
        r.pop("answers", None)
        row = {"setting": name, **kw, **r}
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
