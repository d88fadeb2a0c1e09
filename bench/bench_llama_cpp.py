"""llama.cpp against our decoders on the same GGUF file, side by side in one run.

The default model's file (`jacobi_ext.models.default_model_file()`,
SmolLM2-135M-Instruct.Q4_1.gguf), CPU, batch 1, greedy, the same prompt token ids for every row
(the chat-template ids of `jacobi-forcing eval`'s prompts: HumanEval and the held-out packages of
the prompt corpus, half each, HumanEval first), the same threads, the same EOS and max_new_tokens:

1. llama.cpp through llama-cpp-python (`import llama_cpp`): the ids fed with `Llama.eval`, the
   greedy token the argmax of the last logits, one `eval` per token, the state reset between
   prompts. Optional: where `llama_cpp` is not importable its row is skipped, saying so.
   `pip install llama-cpp-python` builds llama.cpp from source (~10 min); it is not part of the
   README's commands: install it in a separate environment (e.g. a venv made with
   --system-site-packages, so that it sees torch and jacobi_ext) and run this file with its
   python.
2. ours (`jacobi_ext.generate`): `ar`, `jacobi` n=16, `multiblock` n=16 and the tuned default
   (`generate(model, ids)`), on the base model (`load_model()`) and the shipped distilled model
   (`load_model("smollm2-jf")`), each loaded as `load_model` loads it by default (the GGUF's own
   codes where this build reads them; `JACOBI_BENCH_DEQUANTIZE=1` / `--dequantize`: fp32,
   dequantized, as transformers loads the file); and `ar` and the tuned default of both models
   with `int8_activations=True` ("int8 act.": Q4_1 and Q8_0 codes times 8-bit activations and
   a float16 K/V cache, llama.cpp's kind of arithmetic and its default cache type; their answers
   are checked against that mode's own `ar`). Only where `--rows` names them: the same two on an
   fp32 K/V cache ("int8 act., fp32 K/V"), to measure what the half cache brings.

Every call is timed whole (prefill included: tokens/s of whole calls) and in its two parts: the
prefill (the prompt's forward and the first token) and the steady decode after it (steady ms per
generated token, ms per forward). Every (row, prompt) runs ROUNDS times, round-robin over the
rows, after one untimed warm-up call per row on the longest prompt; each figure is from the
medians per prompt. Beside them: the quantized floor of one forward, the bytes of the GGUF's
weights (the tied token embedding counted once, as the LM head) over the machine's read
bandwidth read between the timed calls (after each prompt's calls, `x.sum()` over as many
bytes of fp32 as the weights, the fastest of a few reads in a row: the pace at which weights read
every forward come back from wherever they settle, a cache where they fit in one; the median,
and the range in the table); how many answers equal our own `ar` token for
token (asserted for our methods: they are lossless) and how many equal llama.cpp's greedy (a
different kernel sums in a different order: at a near-tie the two greedy outputs may part; the
distilled model's answers are another model's).

    python bench/bench_llama_cpp.py --out runs/llama_cpp        # results.json and table.md
    /path/to/llama-venv/bin/python bench/bench_llama_cpp.py --out runs/llama_cpp  # with llama.cpp
    python bench/bench_llama_cpp.py --quick --out /tmp/llbench  # seconds-long smoke run
    python bench/bench_llama_cpp.py --rows "tuned (default) [smollm2-jf, int8 act.]" --rounds 6 \
        --out runs/llama_cpp_tuned  # llama.cpp, that row and its model's ar, call after call
    python bench/bench_llama_cpp.py --no-llama --rounds 6 --out runs/kv --rows \
        "tuned (default) [smollm2-jf, int8 act.];tuned (default) [smollm2-jf, int8 act., fp32 K/V]"
    pytest bench/bench_llama_cpp.py -o python_files='bench_*.py' --benchmark-json=llama_cpp.json
    JACOBI_BENCH_QUICK=1 pytest bench/bench_llama_cpp.py -o python_files='bench_*.py'  # smoke

Environment: JACOBI_BENCH_PROMPTS (8), JACOBI_BENCH_MAX_NEW (128), JACOBI_BENCH_THREADS (2),
JACOBI_BENCH_ROUNDS (3), JACOBI_BENCH_DEQUANTIZE (0); JACOBI_BENCH_QUICK=1: 1 prompt, 16 new
tokens, 1 round. Keep the machine otherwise idle while it runs: the rows share its cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

QUICK = os.environ.get("JACOBI_BENCH_QUICK", "") not in ("", "0")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


PROMPTS = 1 if QUICK else _env_int("JACOBI_BENCH_PROMPTS", 8)
MAX_NEW = 16 if QUICK else _env_int("JACOBI_BENCH_MAX_NEW", 128)
THREADS = _env_int("JACOBI_BENCH_THREADS", 2)
ROUNDS = 1 if QUICK else _env_int("JACOBI_BENCH_ROUNDS", 3)
DEQUANTIZE = os.environ.get("JACOBI_BENCH_DEQUANTIZE", "") not in ("", "0")

LLAMA = "llama.cpp"
# Our rows: label -> generate() keywords (the tuned default is generate's own defaults).
METHODS = {
    "ar": dict(method="ar"),
    "jacobi n=16": dict(method="jacobi", block_size=16),
    "multiblock n=16": dict(method="multiblock", block_size=16),
    "tuned (default)": {},
}
# label -> load_model's name and options; the methods each model runs (default: all of METHODS)
MODELS = {
    "base": (None, {}),
    "smollm2-jf": ("smollm2-jf", {}),
    "base, int8 act.": (None, {"int8_activations": True}),
    "smollm2-jf, int8 act.": ("smollm2-jf", {"int8_activations": True}),
}
# Models run only where --rows names one of their rows (a side-by-side comparison, not the
# table's): the 8-bit mode with an fp32 K/V cache instead of its default fp16 one.
EXTRA_MODELS = {
    "base, int8 act., fp32 K/V": (None, {"int8_activations": True, "kv_cache_dtype": "float32"}),
    "smollm2-jf, int8 act., fp32 K/V": (
        "smollm2-jf", {"int8_activations": True, "kv_cache_dtype": "float32"}
    ),
}  # fmt: skip
MODEL_METHODS = {
    label: ("ar", "tuned (default)")
    for label in ("base, int8 act.", "smollm2-jf, int8 act.", *EXTRA_MODELS)
}
LLAMA_MISSING = (
    "llama.cpp row skipped: `import llama_cpp` failed ({exc}). `pip install llama-cpp-python` "
    "builds llama.cpp from source (~10 min) and is not part of the README's commands: install "
    "it in a separate environment (python -m venv --system-site-packages VENV; "
    "VENV/bin/pip install llama-cpp-python) and run this file with VENV/bin/python."
)


# ---- what every row shares ------------------------------------------------------------------


def load_prompt_ids(tokenizer, n: int) -> list[tuple[str, list[int]]]:
    """(name, ids) of `jacobi-forcing eval`'s first prompts, formatted as it formats them:
    ceil(n/2) HumanEval problems, then floor(n/2) of the prompt corpus' held-out packages."""
    from jacobi_ext.data import humaneval_input_ids, load_humaneval

    n_he, n_held = (n + 1) // 2, n // 2
    out = [
        (p["task_id"], humaneval_input_ids(tokenizer, p)[0].tolist()) for p in load_humaneval(n_he)
    ]
    if n_held:
        from python_training.prompts import load_prompts

        out += [
            (p.id, p.input_ids(tokenizer)[0].tolist()) for p in load_prompts("code-heldout", n_held)
        ]
    return out


def gguf_weight_bytes(path) -> tuple[int, dict]:
    """Bytes of the weights one forward reads from the GGUF file: every tensor once; the token
    embedding is read whole only as a tied LM head (as a lookup table a forward reads a row of
    it), so it counts once where the LM head is tied and not at all where `output.weight` is
    the LM head. Returns (bytes, bytes per tensor type)."""
    import gguf

    tensors = gguf.GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    total, by_type = 0, {}
    for t in tensors:
        if t.name == "token_embd.weight" and not tied:
            continue
        total += int(t.n_bytes)
        name = t.tensor_type.name
        by_type[name] = by_type.get(name, 0) + int(t.n_bytes)
    return total, {"tied_lm_head": tied, "bytes_by_type": by_type}


class BandwidthProbe:
    """GB/s of `x.sum()` over `nbytes` of fp32 (the bytes a forward reads: the GGUF's weights)
    with torch's current threads, one reading a call: the buffer read once untimed, then the
    fastest of four timed reads back to back (jacobi_ext.tools.roofline.reread_gbps). A decode
    loop reads the same weights every forward, so they stream from wherever a working set of
    their size settles: on a CPU whose cache holds them, that cache, and a floor is the fastest
    such pace. (On a 2-core Xeon with
    AMX, 2026-12-01: repeated reads of 24-97 MB ran at 51-55 GB/s, of 200-800 MB at 27-30; after
    400 MB of other reads, four reads of 97 MB in a row ran at 22-32, 23-32, 27-38, 36-44 GB/s.
    A fixed 400 MB buffer, the first version, put the default model's floor at half the pace its
    weights can be read at, and the 8-bit forward at 0.9-1.03x it.) The run takes one reading
    after each prompt's calls, so the floor's bandwidth is read in the same minutes as the
    forwards it is compared with (on a shared 2-core machine the readings moved 12-58 GB/s within
    one run)."""

    def __init__(self, nbytes: int) -> None:
        self.x = torch.ones(max(nbytes // 4, 1))
        self.x.sum()  # warm-up: pages touched, threads up
        self.readings: list[float] = []

    def __call__(self) -> float:
        from jacobi_ext.tools.roofline import reread_gbps  # the tune command's floor, too

        self.readings.append(reread_gbps(self.x))
        return self.readings[-1]


# ---- one whole call of each kind --------------------------------------------------------------


def llama_extra_bufts(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether llama.cpp loads the weights into its extra buffer types (its AMX and repacked CPU
    layouts), as it does by default: not where the CPU has AMX-INT8, where llama.cpp's AMX
    matmul segfaults at the first eval (ggml-org/llama.cpp#20824; seen with llama-cpp-python
    0.3.36 on a Xeon with AMX, 2026-12-01), so llama.cpp runs its AVX-512 / VNNI code on the
    file's own layout there. JACOBI_BENCH_LLAMA_EXTRA_BUFTS=1 / 0 decides instead."""
    forced = os.environ.get("JACOBI_BENCH_LLAMA_EXTRA_BUFTS", "").strip()
    if forced:
        return forced != "0"
    try:
        with open(cpuinfo) as f:
            return "amx_int8" not in f.read().split()
    except OSError:
        return True


class LlamaCppGreedy:
    """llama.cpp's greedy decoding of given token ids, one `eval` per new token, in a process of
    its own (bench/llama_cpp_worker.py: ggml's OpenMP beside torch's would slow both)."""

    def __init__(self, path, threads: int, n_ctx: int, extra_bufts: bool = True) -> None:
        import subprocess

        worker = Path(__file__).with_name("llama_cpp_worker.py")
        argv = [sys.executable, str(worker), str(path), str(threads), str(n_ctx)]
        self.proc = subprocess.Popen(
            argv + ([] if extra_bufts else ["off"]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"the llama.cpp worker did not start ({worker})")
        hello = json.loads(hello)
        self.version, self.extra_bufts = hello["version"], hello["extra_bufts"]

    def __call__(self, ids: list[int], max_new: int, eos: set[int]) -> dict:
        req = {"ids": list(map(int, ids)), "max_new": max_new, "eos": sorted(eos)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def ours(model, ids: torch.Tensor, max_new: int, eos: set[int], kw: dict) -> dict:
    """One `generate` call, timed whole; the engine splits it into prefill and steady decode."""
    from jacobi_ext import generate

    with torch.inference_mode():
        t0 = time.perf_counter()
        res = generate(model, ids, max_new_tokens=max_new, eos_token_id=sorted(eos), **kw)
        seconds = time.perf_counter() - t0
    n = res.new_tokens
    return dict(
        tokens=res.tokens[0, :n].tolist(), seconds=seconds, prefill_seconds=res.prefill_seconds,
        decode_seconds=res.seconds, forwards=res.forwards,
        settings=f"{res.method} n={res.block_size} K={res.num_blocks} p={res.pool_size}",
    )  # fmt: skip


# ---- the benchmark ----------------------------------------------------------------------------


def model_labels(dequantize: bool, extra: bool = False) -> list[str]:
    """The models a run loads (8-bit activations run on the codes only); `extra`: with
    EXTRA_MODELS (those a --rows run may ask for)."""
    return [
        label
        for label, (_, options) in (MODELS | EXTRA_MODELS if extra else MODELS).items()
        if not (dequantize and options.get("int8_activations"))
    ]


def our_rows(dequantize: bool, extra: bool = False) -> list[str]:
    """Our rows of a run, as the table names them: "method [model label]"."""
    return [
        f"{m} [{label}]"
        for label in model_labels(dequantize, extra)
        for m in MODEL_METHODS.get(label, METHODS)
    ]


def _load_models(dequantize: bool, log, labels=None) -> tuple[dict, dict, object]:
    """{label: model}, {label: what its linears read}, and the tokenizer (the models share it);
    `labels`: just these models (default: every one of the run)."""
    from jacobi_ext.decoding.tuning import step_curve
    from jacobi_ext.models import load_model
    from jacobi_ext.models.quantized import is_quantized, kv_cache_dtype

    models, weights, tokenizer = {}, {}, None
    for label in model_labels(dequantize, extra=labels is not None):
        if labels is not None and label not in labels:
            continue
        name, options = (MODELS | EXTRA_MODELS)[label]
        t0 = time.perf_counter()
        model, tok = load_model(name, **({"dequantize": True} if dequantize else options))
        models[label] = model
        tokenizer = tokenizer or tok
        weights[label] = "GGUF codes" if is_quantized(model) else "fp32 (dequantized)"
        if options.get("int8_activations"):
            weights[label] += ", int8 activations"
        if kv_cache_dtype(model) == torch.float16:
            weights[label] += ", fp16 K/V cache"
        step_curve(model)  # the tuner's curve, once per machine: not charged to a timed call
        log(f"loaded {label} ({weights[label]}) in {time.perf_counter() - t0:.1f} s")
    return models, weights, tokenizer


def _measure(
    callers: dict, named: list, rounds: int, log, probe=None
) -> dict[str, list[list[dict]]]:
    """calls[row][prompt] = that (row, prompt)'s call of every round: one untimed warm-up call
    per row on the longest prompt (runtimes sized, weights packed, threads up), then `rounds`
    rounds, each prompt by every row in turn (round-robin: load swings hit every row alike), the
    order of the rows reversed from one prompt to the next (no row always first after another).
    `probe` (a BandwidthProbe): read after each prompt's calls."""
    longest = max((ids for _, ids in named), key=len)
    for fn in callers.values():
        fn(longest)
    calls = {row: [[] for _ in named] for row in callers}
    order = list(callers.items())
    for r in range(rounds):
        for i, (_, ids) in enumerate(named):
            for row, fn in order if (r * len(named) + i) % 2 == 0 else order[::-1]:
                calls[row][i].append(fn(ids))
            if probe is not None:
                probe()
        speeds = []
        for row, per in calls.items():
            tokens = sum(len(c[r]["tokens"]) for c in per)
            speeds.append(f"{row} {tokens / sum(c[r]['seconds'] for c in per):.1f}")
        log(f"round {r + 1}/{rounds}, tokens/s: " + ", ".join(speeds))
    return calls


def _row(row: str, per: list[list[dict]], named: list, ar: list | None, ll: list | None) -> dict:
    """One row's figures from its calls (medians per prompt over the rounds); `ar`: our `ar`'s
    answers on the same model (None for llama.cpp's row where that `ar` row was not run), `ll`:
    llama.cpp's (None where its row is skipped)."""
    med = {
        k: [statistics.median(c[k] for c in calls) for calls in per]
        for k in ("seconds", "prefill_seconds", "decode_seconds")
    }
    answers = [calls[0]["tokens"] for calls in per]
    tokens = [len(a) for a in answers]
    forwards = [calls[0]["forwards"] for calls in per]
    steady_tokens = sum(tokens) - len(tokens)  # the prefill yields each call's first token
    decode = sum(med["decode_seconds"])
    per_prompt = [
        dict(prompt=name, prompt_tokens=len(ids), new_tokens=t, forwards=f, seconds=s,
             prefill_seconds=p, decode_seconds=d)
        for (name, ids), t, f, s, p, d in zip(
            named, tokens, forwards, med["seconds"], med["prefill_seconds"],
            med["decode_seconds"], strict=True,
        )
    ]  # fmt: skip
    return dict(
        row=row,
        new_tokens=sum(tokens),
        tokens_per_s=sum(tokens) / sum(med["seconds"]),
        steady_ms_per_token=1e3 * decode / max(steady_tokens, 1),
        ms_per_forward=1e3 * decode / max(sum(forwards), 1),
        tokens_per_forward=steady_tokens / max(sum(forwards), 1),
        prefill_ms=1e3 * statistics.mean(med["prefill_seconds"]),
        same_as_ar=None if ar is None else sum(a == b for a, b in zip(answers, ar, strict=True)),
        same_as_llama=None if ll is None else sum(a == b for a, b in zip(answers, ll, strict=True)),
        deterministic=all(c["tokens"] == calls[0]["tokens"] for calls in per for c in calls),
        settings=sorted({c["settings"] for calls in per for c in calls if "settings" in c}),
        per_prompt=per_prompt,
    )


def run(
    prompts: int = PROMPTS,
    max_new: int = MAX_NEW,
    threads: int = THREADS,
    rounds: int = ROUNDS,
    dequantize: bool = DEQUANTIZE,
    llama: bool = True,
    check: bool = True,
    only: list[str] | None = None,
    log=print,
) -> list[dict]:
    """Measure every row; returns one dict per row: llama.cpp's (or its skip reason), ours (per
    model and method), and the quantized floor's. `check`: assert, after measuring, that our
    methods' answers equal our `ar`'s token for token. `only`: just these of our rows (as the
    table names them, e.g. "tuned (default) [smollm2-jf, int8 act.]"), with the `ar` row of each
    one's model (the answers they are checked against); only their models are loaded, and a
    name that is not a row is refused before anything is (ValueError)."""
    from jacobi_ext.models import default_model_file

    known = our_rows(dequantize, extra=only is not None)
    unknown = sorted(set(only or ()) - set(known))
    if unknown:  # before anything is loaded
        raise ValueError(f"unknown rows {unknown}; our rows here: {known}")
    # the asked rows' models (each row's `ar` runs on its own model)
    labels = None if only is None else {r.split(" [", 1)[1][:-1] for r in only}
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    llm = None
    try:
        path = default_model_file()
        models, weights, tokenizer = _load_models(dequantize, log, labels)
        named = load_prompt_ids(tokenizer, prompts)
        eos_cfg = next(iter(models.values())).generation_config.eos_token_id  # (one tokenizer)
        eos = {eos_cfg} if isinstance(eos_cfg, int) else set(eos_cfg or ())

        callers, model_of, skipped = {}, {}, None  # row -> fn(ids) -> call dict; row -> model
        if not llama:
            skipped = "llama.cpp row skipped: not asked for (--no-llama)"
        else:
            try:
                import llama_cpp  # noqa: F401
            except ImportError as exc:
                skipped = LLAMA_MISSING.format(exc=exc)
        if skipped is None:
            n_ctx = max(len(ids) for _, ids in named) + max_new + 64
            extra = llama_extra_bufts()
            llm = LlamaCppGreedy(path, threads, n_ctx=-(-n_ctx // 256) * 256, extra_bufts=extra)
            if not extra:
                log("llama.cpp: weights in its own layout, without its extra buffer types (AMX)")
            callers[LLAMA] = lambda ids: llm(ids, max_new, eos)
            model_of[LLAMA] = "base"
        else:
            log(skipped)
        keep = None if only is None else {*only, *(f"ar [{label}]" for label in labels)}
        for label, model in models.items():
            for method in MODEL_METHODS.get(label, METHODS):
                kw = METHODS[method]
                row = f"{method} [{label}]"
                if keep is not None and row not in keep:
                    continue
                callers[row] = lambda ids, m=model, kw=kw: ours(
                    m, torch.tensor([ids], dtype=torch.long), max_new, eos, kw
                )
                model_of[row] = label

        nbytes, detail = gguf_weight_bytes(path)
        probe = BandwidthProbe(nbytes)
        calls = _measure(callers, named, rounds, log, probe)
        # The floor from the readings taken between the timed calls (median, range reported).
        bw = statistics.median(probe.readings)
        bw_range = (min(probe.readings), max(probe.readings))
        floor_ms = nbytes / (bw * 1e9) * 1e3
        log(
            f"read bandwidth {bw:.1f} GB/s (median of {len(probe.readings)} readings between the "
            f"calls, {bw_range[0]:.1f}-{bw_range[1]:.1f}); {nbytes / 1e6:.1f} MB of GGUF weights "
            f"per forward: floor {floor_ms:.2f} ms per forward"
        )

        common = dict(
            prompts=len(named), max_new_tokens=max_new, threads=threads, rounds=rounds,
            model_file=path.name, read_gbps=round(bw, 2),
            read_gbps_range=[round(v, 2) for v in bw_range], gguf_weight_mb=round(nbytes / 1e6, 2),
            floor_ms_per_forward=round(floor_ms, 3),
        )  # fmt: skip
        answers = {row: [c[0]["tokens"] for c in per] for row, per in calls.items()}
        rows = []
        if skipped and llama:
            rows.append(
                dict(row=LLAMA, model="base", weights="GGUF (llama.cpp)", skipped=skipped, **common)
            )
        for row, per in calls.items():
            ar = answers.get(f"ar [{model_of[row]}]")  # (ours: always run; llama.cpp's: base's)
            r = _row(row, per, named, ar, answers.get(LLAMA))
            r.update(model=model_of[row], **common)
            r["weights"] = "GGUF (llama.cpp)" if row == LLAMA else weights[model_of[row]]
            if row == LLAMA:
                r["llama_cpp_version"] = llm.version
                r["llama_cpp_extra_bufts"] = llm.extra_bufts
                if not llm.extra_bufts:
                    r["settings"] = ["no extra buffer types (AMX)"]
            rows.append(r)
        ref = next((r["tokens_per_s"] for r in rows if r["row"] == LLAMA and not skipped), None)
        rows.append(
            dict(
                row="quantized floor", model="-", weights=f"GGUF, {nbytes / 1e6:.1f} MB read",
                tokens_per_s=1e3 / floor_ms, steady_ms_per_token=floor_ms,
                ms_per_forward=floor_ms, tokens_per_forward=1.0, gguf=detail, **common,
            )
        )  # fmt: skip
        for r in rows:
            if "tokens_per_s" in r:
                r["vs_llama_cpp"] = r["tokens_per_s"] / ref if ref else None
                r["x_floor"] = r["ms_per_forward"] / floor_ms
    finally:
        if llm is not None:
            llm.close()
        torch.set_num_threads(old_threads)
    if check:
        check_lossless(rows)
    return rows


def check_lossless(rows: list[dict]) -> None:
    """Our methods are lossless: every answer equals our `ar`'s, in every round."""
    bad = [
        f"{r['row']}: {r['same_as_ar']}/{r['prompts']} equal ar"
        + ("" if r["deterministic"] else ", rounds differ")
        for r in rows
        if r["row"] not in (LLAMA, "quantized floor")
        and "skipped" not in r
        and (r["same_as_ar"] != r["prompts"] or not r["deterministic"])
    ]
    assert not bad, "our decoding was not lossless: " + "; ".join(bad)


# ---- the report -------------------------------------------------------------------------------


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(rows: list[dict], meta: dict | None = None) -> str:
    c = rows[-1]
    lo, hi = c.get("read_gbps_range") or (None, None)
    span = "" if lo is None else f" (median of the readings between the calls, {lo:.1f}-{hi:.1f})"
    out = [
        f"# llama.cpp and jacobi_ext on {c['model_file']}",
        "",
        f"{c['prompts']} prompts (`jacobi-forcing eval`'s: HumanEval, then held-out packages), "
        f"up to {c['max_new_tokens']} new tokens, greedy, batch 1, {c['threads']} threads, "
        f"medians of {c['rounds']} round(s); read bandwidth {c['read_gbps']:.1f} GB/s{span}, "
        f"{c['gguf_weight_mb']:.1f} MB of GGUF weights per forward.",
    ]
    if meta:
        out.append(", ".join(f"{k}: {v}" for k, v in meta.items()) + ".")
    out += [
        "",
        "| row | weights | tokens/s (whole calls) | vs llama.cpp | steady ms / token | "
        "ms / forward | x floor | tokens / forward | prefill ms | = our ar | = llama.cpp | "
        "settings |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['row']} | {r['weights']} | skipped | | | | | | | | | |")
            continue
        n = r["prompts"]
        same_ar = f"{r['same_as_ar']}/{n}" if r.get("same_as_ar") is not None else ""
        same_ll = f"{r['same_as_llama']}/{n}" if r.get("same_as_llama") is not None else ""
        vs = r.get("vs_llama_cpp")
        out.append(
            f"| {r['row']} | {r['weights']} | {r['tokens_per_s']:.1f} | "
            f"{'' if vs is None else f'{vs:.2f}x'} | {r['steady_ms_per_token']:.2f} | "
            f"{r['ms_per_forward']:.2f} | {r['x_floor']:.2f} | {r['tokens_per_forward']:.2f} | "
            f"{_f(r.get('prefill_ms'), '.1f')} | {same_ar} | {same_ll} | "
            f"{'; '.join(r.get('settings') or [])} |"
        )
    out += [
        "",
        "tokens/s: all new tokens over the medians of whole calls (prefill included). Steady: the "
        "decode after the prefill (which yields the first token). x floor: ms per forward over "
        "the quantized floor (GGUF weight bytes / the read bandwidth of as many bytes, the "
        "fastest of a few reads in a row; a forward of several tokens "
        "also does more arithmetic). = our ar: answers equal to our `ar` of the same model "
        "(llama.cpp: of the base model) token for token.",
    ]
    skipped = [r["skipped"] for r in rows if "skipped" in r]
    return "\n".join(out + ([""] + skipped if skipped else [])) + "\n"


def _meta(rows) -> dict:
    from jacobi_ext.decoding.tuning import cpu_name

    versions = {"torch": torch.__version__}
    try:
        from jacobi_ext._version import __version__

        versions["jacobi_ext"] = __version__
    except ImportError:
        pass
    llama = next((r.get("llama_cpp_version") for r in rows if r.get("llama_cpp_version")), None)
    if llama:
        versions["llama_cpp_python"] = llama
    return dict(
        cpu=cpu_name(), date=datetime.date.today().isoformat(), quick=QUICK,
        **{f"{k} version": v for k, v in versions.items()},
    )  # fmt: skip


def main(argv=None) -> int:
    global QUICK
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for results.json and table.md")
    ap.add_argument("--quick", action="store_true", help="1 prompt, 16 new tokens, 1 round")
    ap.add_argument("--prompts", type=int, default=None, help=f"default {PROMPTS}")
    ap.add_argument("--max-new", type=int, default=None, help=f"default {MAX_NEW}")
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--rounds", type=int, default=None, help=f"default {ROUNDS}")
    ap.add_argument(
        "--dequantize",
        action="store_true",
        default=DEQUANTIZE,
        help="our models in fp32, dequantized as transformers loads the GGUF",
    )
    ap.add_argument("--no-llama", action="store_true", help="skip the llama.cpp row")
    ap.add_argument(
        "--rows",
        default=None,
        help="only these of our rows, separated by ';' (as the table names them, e.g. "
        "'tuned (default) [smollm2-jf, int8 act.]'; each model's `ar` row is kept too): fewer "
        "rows between llama.cpp's call and theirs, for more rounds in the same time",
    )
    args = ap.parse_args(argv)
    QUICK = QUICK or args.quick
    default = (1, 16, 1) if QUICK else (PROMPTS, MAX_NEW, ROUNDS)
    only = None if args.rows is None else [r.strip() for r in args.rows.split(";") if r.strip()]
    try:
        rows = run(
            prompts=args.prompts or default[0], max_new=args.max_new or default[1],
            threads=args.threads, rounds=args.rounds or default[2], dequantize=args.dequantize,
            llama=not args.no_llama, check=False,
            only=only,
        )  # fmt: skip
    except ValueError as exc:
        ap.error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = _meta(rows)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    table = markdown(rows, meta)
    (out / "table.md").write_text(table)
    print(table)
    print(f"wrote {out / 'results.json'} and {out / 'table.md'}")
    try:
        check_lossless(rows)
    except AssertionError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


@pytest.mark.slow
def test_llama_cpp_side_by_side(benchmark):
    """The whole comparison once (JACOBI_BENCH_QUICK=1: 1 prompt, 16 new tokens); the rows go
    into extra_info. Without llama_cpp (as in CI) its row is skipped and the rest must pass."""
    box = {}
    benchmark.pedantic(lambda: box.update(rows=run()), rounds=1, iterations=1)
    rows = box["rows"]
    print("\n" + markdown(rows, _meta(rows)))
    ours_rows = [r for r in rows if r["row"] not in (LLAMA, "quantized floor")]
    assert len(ours_rows) == len(our_rows(DEQUANTIZE))
    lo, hi = rows[-1]["read_gbps_range"]
    assert 0 < lo <= rows[-1]["read_gbps"] <= hi  # the floor's readings, taken between the calls
    assert all(r["tokens_per_s"] > 0 and r["same_as_ar"] == r["prompts"] for r in ours_rows)
    benchmark.extra_info.update(
        model_file=rows[-1]["model_file"], prompts=rows[-1]["prompts"],
        max_new_tokens=rows[-1]["max_new_tokens"], threads=rows[-1]["threads"],
        read_gbps=rows[-1]["read_gbps"], floor_ms_per_forward=rows[-1]["floor_ms_per_forward"],
        llama_cpp=any(r["row"] == LLAMA and "skipped" not in r for r in rows),
        rows=[{k: v for k, v in r.items() if k != "per_prompt"} for r in rows],
    )  # fmt: skip


def test_unknown_rows_are_refused_before_anything_loads(monkeypatch):
    """`--rows` with a name that is not a row fails at once, naming the rows there are."""
    import jacobi_ext.models

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded for a refused row")

    monkeypatch.setattr(jacobi_ext.models, "load_model", no_loading)
    with pytest.raises(ValueError, match=r"unknown rows \['tuned \[nope\]'\].*ar \[base\]"):
        run(only=["tuned [nope]"], llama=False)


if __name__ == "__main__":
    sys.exit(main())
