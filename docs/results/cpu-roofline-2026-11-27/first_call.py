"""Issue 36 §5: the first tuned call on a fresh cache against the same call warm, per prompt.

For each prompt: a fresh tuner cache (JACOBI_EXT_CACHE: a new empty folder), then the tuned
default (`generate(model, ids, max_new_tokens=128)`) four times. The first call measures the quick
curve inside it; the next ones find it cached. Tuned calls race parallel decoding against AR with
lookup drafts (the second call runs the mode the first did not), so a call is compared with the
warm calls that ran the same mode as it. The model is loaded and its weights packed before (an
`ar` decode), which is the kernel's one-off cost, not the tuner's.

    python first_call.py --model smollm2-jf --prompts humaneval --limit 8 --out first-jf-he.jsonl
    python first_call.py --table first-*.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from side_by_side import _prompts, _text


def run(args) -> None:
    import torch

    from jacobi_ext import generate
    from jacobi_ext.decoding import tuning
    from jacobi_ext.models import load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=torch.float32)
    prompts = _prompts(args.prompts, tok, args.limit)
    generate(model, prompts[0][1], max_new_tokens=8, method="ar")  # packs the weights
    probe = []
    real = tuning.measure_quick_curve

    def timed():
        t0 = time.perf_counter()
        c = real(model)
        probe.append(time.perf_counter() - t0)
        return c

    with open(args.out, "w") as f:
        for pid, ids in prompts:
            os.environ["JACOBI_EXT_CACHE"] = tempfile.mkdtemp(prefix="jacobi-first-")
            tuning.measure_quick_curve = lambda model: timed()
            calls = []
            for _ in range(4):
                t0 = time.perf_counter()
                r = generate(model, ids, max_new_tokens=args.max_new_tokens)
                calls.append(
                    {
                        "s": time.perf_counter() - t0,
                        "mode": r.method,
                        "n": r.block_size,
                        "tokens": r.new_tokens,
                    }
                )
            f.write(json.dumps({"id": pid, "calls": calls, "probe_s": probe[-1]}) + "\n")
            print(pid, [round(c["s"], 2) for c in calls], [c["mode"] for c in calls], flush=True)


def table(paths) -> None:
    for path in paths:
        rows = [json.loads(x) for x in _text(path).splitlines()]
        ratios, firsts, warms, probes = [], 0.0, 0.0, []
        for r in rows:
            first, rest = r["calls"][0], r["calls"][1:]
            same = [c["s"] for c in rest if c["mode"] == first["mode"]] or [c["s"] for c in rest]
            warm = statistics.median(same)
            ratios.append(first["s"] / warm)
            firsts += first["s"]
            warms += warm
            probes.append(r["probe_s"])
        print(
            f"{path}: {len(rows)} prompts; first / warm (same mode): median "
            f"{statistics.median(ratios):.2f}, max {max(ratios):.2f}, total "
            f"{firsts / warms:.2f}; quick probe median {statistics.median(probes):.3f} s"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--table", nargs="+")
    args = ap.parse_args()
    if args.table:
        return table(args.table)
    run(args)


if __name__ == "__main__":
    main()
