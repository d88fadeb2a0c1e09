"""The JF trainer: AR + progressive consistency on packed trajectories (docs/method.md §3).

Built on accelerate rather than transformers' Trainer: every example is one packed sequence with
its own JacobiLayout, a loss that needs the layout around both forward AND backward (activation
checkpointing recomputes attention during backward), and logits for a chosen subset of positions
only; a plain loop over accelerate keeps that explicit, while accelerate still supplies DDP /
FSDP / DeepSpeed ZeRO-3, mixed precision and checkpoint state from an ordinary config file
(`accelerate launch --config_file python_training/recipes/accelerate_fsdp_8gpu.yaml ...`).

Data order is a pure function of (seed, epoch, step): optimizer step s consumes global examples
order[s*G:(s+1)*G] with G = processes × grad_accum, rank r taking micro step a's example
order[s*G + a*world + r]. So a resumed run (model, optimizer, scheduler, RNG and step restored
by ``accelerator.save_state``/``load_state``) sees exactly the batches it would have seen.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import random
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from jacobi_ext.hf import jacobi_layout

from .loss import example_loss
from .packing import PackedExample, pack_record
from .trajectories import read_trajectories

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TRAIN_STATE = "train_state.json"


@dataclass
class TrainConfig:
    model: str | None = None  # None: SmolLM2-135M-Instruct
    data: list[str] = field(default_factory=list)  # trajectory directories
    out: str = "runs/train"
    window: int = 16  # W of the noise schedule
    schedule: str = "linear"  # linear | random | reverse
    variant: str = "noisy_context"  # attention mask: noisy_context | clean_context | windowed
    mask_window: int | None = None
    max_blocks: int | None = None  # cut long trajectories to this many blocks
    max_seq_len: int | None = None  # skip packed sequences longer than this
    # Keep only answers that reached EOS during collection: those cut at the collection cap are
    # often the teacher looping, which the consistency term learns to continue most readily.
    finished_only: bool = False
    ar_weight: float = 10.0  # λ
    # Whether the AR term includes the prompt's next-token pairs (docs/method.md §3) or only the
    # answer's (the bridge into the answer and its in-block pairs): packing.pack's ``ar_prompt``.
    ar_prompt: bool = True
    # μ of the KL to the frozen base model at the AR positions (loss.example_loss; LoRA only):
    # keeps the base's distribution, not only its greedy tokens. 0: docs/method.md §3's objective.
    kl_weight: float = 0.0
    temperature: float = 1.0
    consistency_reduction: str = "mean_div_T"  # docs/method.md §3 (mean / T) | "mean"
    # Synthetic progressive-masking noise (packing.synthetic_state), redrawn every time a
    # sequence is packed: the fraction of blocks whose noisy state is synthetic (the rest take
    # the collected state nearest the schedule's level), the context window the noise tokens
    # come from, the replaced-token count at noise level 1 (None: n), and a saw-tooth phase
    # drawn per packing (so short answers meet every level, not only the first few teeth).
    synthetic_fraction: float = 0.0
    lookback: int = 128
    max_noise_tokens: int | None = None
    random_phase: bool = False
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_ratio: float = 0.03
    epochs: float = 1.0
    max_steps: int | None = None  # optimizer steps; overrides epochs
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    mixed_precision: str = "no"  # no | bf16 | fp16 (accelerate autocast, fp32 master weights)
    gradient_checkpointing: bool = False
    save_every: int = 0  # optimizer steps between resumable checkpoints (0: only at the end)
    keep_checkpoints: int = 2
    # Optimizer steps between plain HF snapshots in ``out/snapshots/step-N`` (0: none). Unlike
    # the resumable checkpoints they are never pruned: they are what a scaling curve (held-out
    # TPF vs training trajectories) is evaluated on after the run.
    snapshot_every: int = 0
    log_every: int = 1
    # LoRA (peft) instead of full weights: the rank (0: full fine-tuning), alpha (None: 2·rank),
    # the adapted modules. A LoRA run also writes its adapter (safetensors) + train_state.json
    # at every save, to ``adapter_out`` (default ``out/adapter``): small enough to commit, so a
    # run can go on on another machine: with no checkpoint in ``out``, training continues from
    # ``adapter_out`` if it holds this run's earlier state (same ``init_adapter``), else from
    # ``init_adapter``.
    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_targets: tuple[str, ...] = LORA_TARGETS
    adapter_out: str | None = None
    init_adapter: str | None = None
    # With ``init_adapter``: keep its weights and token count, but start the data position and
    # the LR schedule (warm-up, cosine to 0) afresh: a new chunk on new data after an annealed
    # one (a warm restart), instead of going on along the old schedule.
    restart_schedule: bool = False
    # End this call after so many minutes (at a step boundary, with a checkpoint and, for LoRA,
    # the adapter saved): a long run goes in chunks; the same command resumes it. None: no limit.
    stop_after_minutes: float | None = None
    seed: int = 0
    threads: int | None = None
    cpu: bool | None = None  # None: CPU when no CUDA device is visible

    def __post_init__(self) -> None:
        if self.restart_schedule and not self.init_adapter:
            raise ValueError(
                "restart_schedule restarts from an adapter: give init_adapter (--init-adapter) "
                "too, or drop restart_schedule (--restart-schedule)"
            )
        if self.kl_weight and not self.lora_rank:
            raise ValueError(
                "kl_weight (--kl-weight) reads the base model as the LoRA adapter switched off: "
                "give lora_rank (--lora-rank) > 0 too, or drop kl_weight"
            )

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown training settings: {sorted(unknown)}")
        d = dict(d)
        for k in ("betas", "lora_targets"):
            if k in d:
                d[k] = tuple(d[k])
        if isinstance(d.get("data"), str):
            d["data"] = [d["data"]]
        return cls(**d)


class _DataState:
    """The data position, checkpointed with accelerate's state (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens = 0  # packed training tokens consumed (all processes)

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        self.tokens = int(sd.get("tokens", 0))


def load_examples(cfg: TrainConfig) -> list[dict]:
    records = []
    for d in cfg.data:
        records += read_trajectories(d)
    if not records:
        raise ValueError(f"no trajectories found in {cfg.data}")
    if cfg.finished_only:
        n = len(records)
        records = [r for r in records if r["finished"]]
        if not records:
            raise ValueError(
                f"none of the {n} trajectories in {cfg.data} reached EOS: finished_only leaves "
                "nothing to train on (collect with a larger --max-new-tokens, or drop the flag)"
            )
    if cfg.max_seq_len is not None:
        keep = []
        for r in records:
            T = min(len(r["blocks"]), cfg.max_blocks or len(r["blocks"]))
            if len(r["prompt_ids"]) + 2 * T * r["block_size"] <= cfg.max_seq_len:
                keep.append(r)
        records = keep
    return records


def global_order(num: int, seed: int, epoch: int) -> list[int]:
    order = list(range(num))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def example_at(records: list[dict], cfg: TrainConfig, global_index: int) -> PackedExample:
    """The packed example at a position of the global stream (epochs concatenated)."""
    epoch, i = divmod(global_index, len(records))
    rec = records[global_order(len(records), cfg.seed, epoch)[i]]
    return pack_record(
        rec,
        window=cfg.window,
        schedule=cfg.schedule,
        # A fresh draw per use (random schedule / phase, synthetic noise): the global index
        # grows across epochs, so a record packed again gets new noise.
        seed=cfg.seed * 7919 + global_index,
        variant=cfg.variant,
        mask_window=cfg.mask_window,
        max_blocks=cfg.max_blocks,
        synthetic_fraction=cfg.synthetic_fraction,
        lookback=cfg.lookback,
        max_noise_tokens=cfg.max_noise_tokens,
        random_phase=cfg.random_phase,
        ar_prompt=cfg.ar_prompt,
    )


def cosine_with_warmup(optimizer, warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        p = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, p)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint (its DONE written) under out/checkpoints, or None."""
    cks = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    cks = [c for c in cks if (c / "DONE").exists()]
    return cks[-1] if cks else None


def train(cfg: TrainConfig, model=None, tokenizer=None, progress: bool = True) -> dict:
    """Train (or resume, if ``cfg.out`` has a checkpoint); write ``cfg.out/final`` (an HF
    checkpoint in safetensors) and ``cfg.out/log.jsonl``. Returns the last logged metrics."""
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # cpu=True lets accelerate run a multi-process CPU job (torchrun / accelerate launch) as
    # DDP over gloo; without it a CPU-only torchrun silently gives independent processes.
    cpu = cfg.cpu if cfg.cpu is not None else not torch.cuda.is_available()
    _forget_other_precision(cfg.mixed_precision)
    acc = Accelerator(mixed_precision=cfg.mixed_precision, gradient_accumulation_steps=1, cpu=cpu)
    if acc.num_processes > 1:
        _end_process_group_at_exit()
    out = Path(cfg.out)
    if model is None:
        from jacobi_ext.models import load_model

        # Training needs real weights: a GGUF base is dequantized (its codes are inference-only).
        model, tokenizer = load_model(cfg.model, attn_implementation="jacobi", dequantize=True)
    elif model.config._attn_implementation != "jacobi":
        model.set_attn_implementation("jacobi")
    model.train()
    model.config.use_cache = False
    if cfg.gradient_checkpointing:
        _checkpointing_on(model)
    frozen_bf16 = None
    if cfg.lora_rank:
        model = _with_lora(model, cfg)
        if cfg.mixed_precision == "bf16":
            frozen_bf16 = FrozenLinearsBF16(model)

    records = load_examples(cfg)
    world, rank = acc.num_processes, acc.process_index
    G = world * cfg.grad_accum  # examples per optimizer step
    total = cfg.max_steps or max(1, int(cfg.epochs * len(records) // G))
    warmup = int(round(cfg.warmup_ratio * total))

    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=cfg.betas,
        weight_decay=cfg.weight_decay,
    )
    sched = cosine_with_warmup(opt, warmup, total)
    model, opt = acc.prepare(model, opt)
    data_state = _DataState()
    acc.register_for_checkpointing(sched, data_state)
    resume = latest_checkpoint(out)
    own = resume is None and _own_progress(cfg)
    if resume is not None:
        acc.load_state(str(resume))
    elif own or cfg.init_adapter:
        # Another machine's run goes on (no local checkpoint): the adapter it committed, with its
        # data position and scheduler step. This run's own adapter_out first, when it holds this
        # run's progress (the same init_adapter): the same command, rerun on a fresh machine,
        # goes on from there instead of starting over from init_adapter.
        state = load_adapter_state(
            acc.unwrap_model(model), _adapter_dir(cfg) if own else cfg.init_adapter
        )
        if not own and cfg.restart_schedule:
            state = {"step": 0, "tokens": state.get("tokens", 0)}
        data_state.load_state_dict(state)
        with warnings.catch_warnings():
            # Fast-forwarding the schedule to the committed step, on purpose with no optimizer
            # step between (torch warns that the first LR value would be skipped).
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*before.*optimizer")
            for _ in range(data_state.step):
                sched.step()
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    log_path = out / "log.jsonl"

    bar = tqdm(
        total=total,
        initial=data_state.step,
        desc="train",
        unit="step",
        disable=not (progress and acc.is_main_process),
    )
    last: dict = {}
    t_last = t_start = time.perf_counter()
    while data_state.step < total:
        if cfg.stop_after_minutes is not None and (
            time.perf_counter() - t_start > 60 * cfg.stop_after_minutes
        ):
            _save_checkpoint(acc, out, data_state.step, cfg.keep_checkpoints)
            if cfg.lora_rank:
                save_adapter_state(acc, model, _adapter_dir(cfg), data_state, total, cfg)
            bar.close()
            return {**last, "stopped_early": True}
        s = data_state.step
        sums = torch.zeros(6, dtype=torch.float64)  # ar, cons, ar/cons/seq tokens, kl
        for a in range(cfg.grad_accum):
            ex = example_at(records, cfg, s * G + a * world + rank)
            sync = a == cfg.grad_accum - 1
            ctx = acc.no_sync(model) if not sync else contextlib.nullcontext()
            with ctx:
                with acc.autocast():
                    parts = example_loss(
                        model, ex, cfg.ar_weight, cfg.temperature, cfg.consistency_reduction,
                        cfg.kl_weight,
                    )  # fmt: skip
                # The layout must also be active during backward: checkpointed layers
                # recompute their attention there.
                with jacobi_layout(ex.layout):
                    acc.backward(parts.total / cfg.grad_accum)
            sums += torch.tensor(
                [parts.ar, parts.consistency, parts.ar_tokens, parts.cons_tokens,
                 ex.input_ids.numel(), parts.kl], dtype=torch.float64,
            )  # fmt: skip
        grad_norm = None
        if cfg.max_grad_norm:
            grad_norm = float(acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        data_state.step += 1
        # Mean of the per-example losses over the global batch (all processes).
        sums = acc.reduce(sums.to(acc.device), reduction="sum").cpu()
        now = time.perf_counter()
        last = {
            "step": data_state.step,
            "loss": float((cfg.ar_weight * sums[0] + sums[1] + cfg.kl_weight * sums[5]) / G),
            "ar": float(sums[0] / G),
            "consistency": float(sums[1] / G),
            **({"kl": float(sums[5] / G)} if cfg.kl_weight else {}),
            "lr": sched.get_last_lr()[0],
            "grad_norm": grad_norm,
            "tokens": int(sums[4]),
            "tokens_seen": data_state.tokens + int(sums[4]),
            "examples": data_state.step * G,  # training sequences consumed so far
            "seconds": round(now - t_last, 3),
        }
        t_last = now
        data_state.tokens = last["tokens_seen"]
        if acc.is_main_process:
            if data_state.step % cfg.log_every == 0 or data_state.step == total:
                with open(log_path, "a") as f:
                    f.write(json.dumps(last) + "\n")
            bar.set_postfix(
                ar=f"{last['ar']:.3f}",
                cons=f"{last['consistency']:.3f}",
                **({"kl": f"{last['kl']:.3f}"} if cfg.kl_weight else {}),
            )
            bar.update(1)
        if cfg.save_every and data_state.step % cfg.save_every == 0 and data_state.step < total:
            _save_checkpoint(acc, out, data_state.step, cfg.keep_checkpoints)
            if cfg.lora_rank:
                save_adapter_state(acc, model, _adapter_dir(cfg), data_state, total, cfg)
        if cfg.snapshot_every and data_state.step % cfg.snapshot_every == 0:
            snap = out / "snapshots" / f"step-{data_state.step}"
            if cfg.lora_rank:  # a snapshot is the adapter alone (load_model merges it)
                save_adapter_state(acc, model, snap, data_state, total, cfg)
            elif not (snap / "model.safetensors").exists():
                save_hf(acc, model, tokenizer, snap)
                if cfg.gradient_checkpointing:  # save_hf switched it off for the saved config
                    _checkpointing_on(acc.unwrap_model(model))
    bar.close()
    acc.wait_for_everyone()
    if cfg.lora_rank:
        save_adapter_state(acc, model, _adapter_dir(cfg), data_state, total, cfg)
        if frozen_bf16 is not None:
            frozen_bf16.remove()  # merging changes the weights the copies were made from
        # final/ is a plain merged checkpoint, so eval and load_model treat both kinds alike.
        model = acc.unwrap_model(model).merge_and_unload()
    save_hf(acc, model, tokenizer, out / "final")
    acc.wait_for_everyone()  # the ranks leave together, after the main process has written
    return last


_process_group_end_registered = False


def _end_process_group_at_exit() -> None:
    """A multi-process job destroys its process group when the process ends, before the
    interpreter tears down: a gloo group left to the destructors at exit can abort a rank
    ("terminate called without an active exception", seen once in the two-process test on a
    loaded machine). At exit, not at the end of train(): one process may train several times
    (distill's stages) on the same group."""
    global _process_group_end_registered
    if _process_group_end_registered:
        return
    _process_group_end_registered = True

    def end() -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    atexit.register(end)


def _forget_other_precision(mixed_precision: str) -> None:
    """accelerate keeps one process-wide state and refuses a second Accelerator with another
    mixed precision; a library user may train twice in one process (fp32, then bf16), so the
    process-wide part is dropped then (the distributed part, PartialState, is kept)."""
    from accelerate.state import AcceleratorState

    shared = AcceleratorState._shared_state
    if shared and str(shared.get("_mixed_precision", mixed_precision)) != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)


class FrozenLinearsBF16:
    """bf16 copies of the frozen Linear weights (the base model under LoRA), used while CPU
    autocast runs in bf16. Autocast would cast every fp32 weight to bf16 at every forward (~11%
    of a LoRA step, profile in docs/results/distill-cpu-2026-11-24); the cast of a frozen
    weight is the same every time, so it is made once. Numerics are unchanged: autocast rounds
    the weight to bf16 either way. Outside bf16 autocast, and for a weight changed since (its
    version moved), the module runs as before. The base weights themselves stay fp32, so the
    merged model is exactly base + adapter."""

    def __init__(self, model):
        self.patched = []
        for m in model.modules():
            w = getattr(m, "weight", None)
            if type(m) is torch.nn.Linear and not w.requires_grad and w.dtype == torch.float32:
                b = m.bias.detach().to(torch.bfloat16) if m.bias is not None else None
                cache = (w._version, w.detach().to(torch.bfloat16), b)
                m.forward = self._forward(m, cache)
                self.patched.append(m)

    @staticmethod
    def _forward(m, cache):
        orig = type(m).forward.__get__(m)

        def forward(x):
            version, w16, b16 = cache
            if (
                torch.is_autocast_enabled("cpu")
                and torch.get_autocast_dtype("cpu") == torch.bfloat16
                and x.device.type == "cpu"
                and m.weight._version == version
            ):
                return torch.nn.functional.linear(x, w16, b16)
            return orig(x)

        return forward

    def remove(self) -> None:
        for m in self.patched:
            del m.forward
        self.patched = []


def _with_lora(model, cfg: TrainConfig):
    from peft import LoraConfig, get_peft_model

    from jacobi_ext.models import peft_without_deprecation_warning

    lcfg = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_rank,
        target_modules=list(cfg.lora_targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with peft_without_deprecation_warning():
        return get_peft_model(model, lcfg)


def _adapter_dir(cfg: TrainConfig) -> Path:
    return Path(cfg.adapter_out) if cfg.adapter_out else Path(cfg.out) / "adapter"


def _own_progress(cfg: TrainConfig) -> bool:
    """Whether adapter_out holds this run's own committed state: a LoRA run's train_state whose
    settings start from the same init_adapter (None for a run from the base model)."""
    path = _adapter_dir(cfg) / TRAIN_STATE
    if not cfg.lora_rank or not path.is_file():
        return False
    saved = json.loads(path.read_text()).get("config", {})
    return saved.get("init_adapter") == cfg.init_adapter


def save_adapter_state(acc, model, path: Path, data_state, total: int, cfg: TrainConfig) -> None:
    """The adapter (peft's adapter_model.safetensors + adapter_config.json) and train_state.json:
    the optimizer step (= the data position: the order is a function of seed and step), tokens
    consumed and the settings, written so that a crash mid-save leaves the old state whole."""
    if not acc.is_main_process:
        return
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # Our LoRA targets are projections only, never the embeddings: saying so spares peft its
    # check of the base's vocabulary, which warns when the base is the GGUF-backed default.
    acc.unwrap_model(model).save_pretrained(
        str(tmp), safe_serialization=True, save_embedding_layers=False
    )
    state = {
        "step": data_state.step,
        "tokens": data_state.tokens,
        "total_steps": total,
        "examples": data_state.step * acc.num_processes * cfg.grad_accum,
        "note": "optimizer moments are not stored: a run continued from here restarts them",
        "config": asdict(cfg),
    }
    (tmp / TRAIN_STATE).write_text(json.dumps(state, indent=1) + "\n")
    _portable_adapter_files(tmp, state)
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def _portable_adapter_files(path: Path, state: dict) -> None:
    """peft records the base model as a path of the training machine and writes a blank model
    card; the adapter ships in the repo, so name the base portably and say what it is."""
    from jacobi_ext.models import DEFAULT_MODEL

    base = state["config"].get("model") or DEFAULT_MODEL
    cfg_path = path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(base)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    c = state["config"]
    (path / "README.md").write_text(
        f"# Jacobi Forcing LoRA adapter for {base}\n\n"
        f"Written by `python_training` (jacobi_ext) at optimizer step {state['step']} of "
        f"{state['total_steps']}, after {state['tokens']:,} packed training tokens.\n"
        f"LoRA rank {c.get('lora_rank')}, alpha {c.get('lora_alpha') or 2 * c.get('lora_rank')}, "
        f"learning rate {c.get('lr')}, "
        f"window n = {c.get('window')}, variant {c.get('variant')}.\n\n"
        "Load it merged into its base model with `jacobi_ext.models.load_model(<this folder>)`;\n"
        "`train_state.json` holds the full training settings, and a run given this folder as\n"
        "`adapter_out` or `init_adapter` continues from it.\n"
    )


def load_adapter_state(model, path: str | Path) -> dict:
    """Load an adapter written by save_adapter_state into a peft model; returns its state."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(path)
    f = path / "adapter_model.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"{path} holds no adapter_model.safetensors (not an adapter)")
    res = set_peft_model_state_dict(model, load_file(str(f)))
    unexpected = list(getattr(res, "unexpected_keys", []))
    if unexpected:
        raise ValueError(f"{path}: adapter keys this model does not have: {unexpected[:4]}")
    st = path / TRAIN_STATE
    return json.loads(st.read_text()) if st.is_file() else {"step": 0, "tokens": 0}


def _checkpointing_on(model) -> None:
    # transformers 5 renamed gradient_checkpointing_enable (deprecated, still there) to
    # activation_checkpointing_enable; use whichever this version has.
    kw = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def _save_checkpoint(acc, out: Path, step: int, keep: int) -> None:
    path = out / "checkpoints" / f"step-{step}"
    acc.save_state(str(path))
    acc.wait_for_everyone()
    if acc.is_main_process:
        (path / "DONE").write_text("")  # a checkpoint counts only once complete
        cks = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        for old in cks[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)


def save_hf(acc, model, tokenizer, path: Path) -> None:
    """A normal transformers checkpoint (safetensors) that ``load_model(path)`` loads."""
    state = acc.get_state_dict(model)
    if acc.is_main_process:
        m = acc.unwrap_model(model)
        off = getattr(m, "activation_checkpointing_disable", None) or getattr(
            m, "gradient_checkpointing_disable", None
        )
        if off is not None:
            off()
        # A model loaded from GGUF (the default SmolLM2) carries a GGUF "quantizer" although its
        # weights were dequantised to dense tensors on load; the result is an ordinary model.
        if (
            getattr(m, "hf_quantizer", None) is not None
            and "gguf" in type(m.hf_quantizer).__name__.lower()
        ):
            m.hf_quantizer = None
            if hasattr(m.config, "quantization_config"):
                del m.config.quantization_config
        m.config.use_cache = True
        m.save_pretrained(str(path), state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
    acc.wait_for_everyone()
