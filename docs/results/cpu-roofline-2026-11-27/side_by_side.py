"""Issue 36 §5-§6, side by side: each prompt decoded by every method in turn, in one process.

transformers' greedy of the same model (the baseline: identical tokens, so a ratio of times),
our `ar`, `ar` with lookup drafts, plain `jacobi` n in {8, 16, 32}, `multiblock` (n = 16, K = 2,
pool 4, lookup) and the tuned default (`generate(model, ids)`: multiblock, block size from the
tuner, lookup) — from a fresh tuner cache (JACOBI_EXT_CACHE points at an empty folder).

Before the prompts, the tuner's first call is timed against the same call warm: an `ar` decode
packs the weights (the kernel's one-off cost, not the tuner's), then the tuned default runs
twice on the first prompt (first call: the quick curve is measured inside it).

One JSON line per (prompt, method), appended and fsync'ed: rerunning resumes.

    python side_by_side.py --model smollm2-jf --prompts humaneval --out jf-humaneval.jsonl
    python side_by_side.py --model smollm2-jf --prompts code-heldout --out jf-heldout.jsonl
    python side_by_side.py --prompts humaneval --out base-humaneval.jsonl   # the base model
    python side_by_side.py --table jf-humaneval.jsonl jf-heldout.jsonl base-humaneval.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

METHODS = {
    "ar": dict(method="ar"),
    "ar-lookup": dict(method="ar", lookup=True),
    "jacobi n=8": dict(method="jacobi", block_size=8, lookup=False),
    "jacobi n=16": dict(method="jacobi", block_size=16, lookup=False),
    "jacobi n=32": dict(method="jacobi", block_size=32, lookup=False),
    "multiblock": dict(method="multiblock", block_size=16),
    "tuned": dict(),  # the default: multiblock, tuned block size, lookup drafts
}


def _prompts(name, tok, limit):
    if name == "humaneval":
        from jacobi_ext.data import humaneval_input_ids, load_humaneval

        return [(p["task_id"], humaneval_input_ids(tok, p)) for p in load_humaneval(limit)]
    from python_training.prompts import load_prompts

    return [(p.id, p.input_ids(tok)) for p in load_prompts(name, limit=limit)]


def run(args) -> None:
    os.environ.setdefault("JACOBI_EXT_CACHE", tempfile.mkdtemp(prefix="jacobi-fresh-cache-"))
    import torch

    from jacobi_ext import generate
    from jacobi_ext.models import load_model
    from jacobi_ext.tools.baselines import hf_greedy

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=torch.float32)
    prompts = _prompts(args.prompts, tok, args.limit)
    out = Path(args.out)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            done.add((r["id"], r["method"]))
    eos = model.generation_config.eos_token_id
    with open(out, "a") as f:

        def write(row):
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

        if ("first-call", "tuned") not in done:
            ids = prompts[0][1]
            t0 = time.perf_counter()
            generate(model, prompts[-1][1], max_new_tokens=8, method="ar")  # packs the weights
            pack = time.perf_counter() - t0
            secs = []
            for _ in range(3):  # fresh cache, then warm twice
                t0 = time.perf_counter()
                r = generate(model, ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
                secs.append(time.perf_counter() - t0)
            write(
                {
                    "id": "first-call",
                    "method": "tuned",
                    "first_s": secs[0],
                    "warm_s": secs[1:],
                    "ratio": secs[0] / statistics.median(secs[1:]),
                    "pack_and_ar8_s": pack,
                    "settings": f"{r.method} n={r.block_size} K={r.num_blocks} p={r.pool_size}",
                }
            )
        for pid, ids in prompts:
            for name in ["hf-greedy", *METHODS]:
                if (pid, name) in done:
                    continue
                if name == "hf-greedy":
                    toks, secs = hf_greedy(model, ids, args.max_new_tokens)
                    forwards, settings = len(toks), "transformers greedy"
                else:
                    t0 = time.perf_counter()
                    r = generate(
                        model,
                        ids,
                        max_new_tokens=args.max_new_tokens,
                        eos_token_id=eos,
                        **METHODS[name],
                    )
                    secs = time.perf_counter() - t0  # the whole call, prefill and tuning included
                    toks, forwards = r.tokens[0, : r.new_tokens].tolist(), r.forwards
                    settings = f"{r.method} n={r.block_size} K={r.num_blocks} p={r.pool_size}"
                write(
                    {
                        "id": pid,
                        "method": name,
                        "tokens": toks,
                        "seconds": secs,
                        "forwards": forwards,
                        "settings": settings,
                    }
                )
            print(pid, flush=True)


def _text(path) -> str:
    """A results file's text (gzipped where its name ends in .gz, as committed)."""
    import gzip

    data = Path(path).read_bytes()
    return (gzip.decompress(data) if str(path).endswith(".gz") else data).decode()


def table(paths) -> None:
    for path in paths:
        rows = [json.loads(x) for x in _text(path).splitlines()]
        first = [r for r in rows if r["id"] == "first-call"]
        by = {}
        for r in rows:
            if r["id"] != "first-call":
                by.setdefault(r["method"], {})[r["id"]] = r
        ids = [i for i in by["hf-greedy"] if all(i in by[m] for m in by)]
        print(f"\n{path}: {len(ids)} prompts")
        if first:
            f = first[0]
            print(
                f"first tuned call {f['first_s']:.2f} s, warm {min(f['warm_s']):.2f}/"
                f"{max(f['warm_s']):.2f} s: ratio {f['ratio']:.2f} ({f['settings']})"
            )
        g = by["hf-greedy"]
        gt = sum(len(g[i]["tokens"]) for i in ids) / sum(g[i]["seconds"] for i in ids)
        ar = by.get("ar", {})
        print(
            "| method | tokens/s | vs transformers greedy | median per prompt | TPF | "
            "identical to our ar | identical to transformers' greedy |"
        )
        print("|---|---|---|---|---|---|---|")
        for m, rs in by.items():
            tok = sum(len(rs[i]["tokens"]) for i in ids)
            sec = sum(rs[i]["seconds"] for i in ids)
            fw = sum(rs[i]["forwards"] for i in ids)
            per = statistics.median(
                (len(rs[i]["tokens"]) / rs[i]["seconds"]) / (len(g[i]["tokens"]) / g[i]["seconds"])
                for i in ids
            )
            same_ar = sum(rs[i]["tokens"] == ar[i]["tokens"] for i in ids if i in ar)
            same_g = sum(rs[i]["tokens"] == g[i]["tokens"] for i in ids)
            print(
                f"| {m} | {tok / sec:.1f} | {tok / sec / gt:.2f}x | {per:.2f}x | {tok / fw:.2f} | "
                f"{same_ar}/{len(ids)} | {same_g}/{len(ids)} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--table", nargs="+")
    args = ap.parse_args()
    if args.table:
        return table(args.table)
    print(platform.processor(), sys.version.split()[0], file=sys.stderr)
    run(args)


if __name__ == "__main__":
    main()
