"""One decoding step, the lean forward against transformers' (JACOBI_EXT_LEAN=1 / 0), side by
side: the first figures a GPU job takes (seconds, before the decoding bench), so that a step that
regressed or a fused op that fails shows at once.

For each forward and step width q, the step runs exactly as the engine runs it
(runtime.StepProbe: the same runtime, buckets and CUDA graph replay), timed as the median of
`--rounds` batches of `--iters` steps (CUDA events on a GPU); the logits' argmax of the two
forwards is compared on the same inputs. SmolLM2-135M's shape with random weights (no model
file), or `--tiny` for a quick check on any machine.

    python bench/step_ab.py --device cuda --dtype bf16 --json step_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _model(tiny: bool, dev: torch.device, dtype: torch.dtype):
    """Random weights: SmolLM2-135M's architecture (kernel_count's, as the kernel count uses),
    or with `tiny` the tests' tiny Llama."""
    from transformers import LlamaForCausalLM

    from jacobi_ext.models import tiny_llama
    from jacobi_ext.tools.kernel_count import smollm2_135m_config

    torch.manual_seed(0)
    model = tiny_llama(seed=0) if tiny else LlamaForCausalLM(smollm2_135m_config())
    return model.to(dev, dtype).eval()


def _time(fn, dev: torch.device, iters: int, rounds: int) -> float:
    """Median seconds of one call, over `rounds` batches of `iters` calls."""
    fn()
    fn()
    out = []
    for _ in range(rounds):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            torch.cuda.synchronize(dev)
            out.append(a.elapsed_time(b) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t0) / iters)
    return statistics.median(out)


def run(device: str, dtype: torch.dtype, widths: list[int], tiny: bool, iters: int,
        rounds: int, context: int) -> dict:  # fmt: skip
    from jacobi_ext.decoding.runtime import StepProbe

    dev = torch.device(device)
    model = _model(tiny, dev, dtype)
    rows, argmax = [], {}
    saved = os.environ.get("JACOBI_EXT_LEAN")
    try:
        for lean in ("0", "1"):
            os.environ["JACOBI_EXT_LEAN"] = lean
            model.__dict__.pop("_jacobi_ext_lean_decoder", None)
            probe = StepProbe(model, context=context, max_q=max(widths))
            forward = type(probe.rt._lean).__name__ if probe.rt._lean else "transformers"
            for q in widths:
                s = _time(lambda q=q, p=probe: p(q), dev, iters, rounds)
                rows.append(dict(lean=lean == "1", forward=forward, q=q, ms_per_step=1e3 * s))
            argmax[lean] = probe(max(widths)).flatten().tolist()  # (the targets: token ids)
    finally:
        if saved is None:
            os.environ.pop("JACOBI_EXT_LEAN", None)
        else:
            os.environ["JACOBI_EXT_LEAN"] = saved
    same = sum(a == b for a, b in zip(argmax["0"], argmax["1"], strict=True))
    return dict(device=str(dev), dtype=str(dtype), context=context, rows=rows,
                argmax_agree=f"{same}/{len(argmax['0'])}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--widths", default="1,16,64")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model: a quick check")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--json", default=None, help="write the result here")
    a = ap.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    widths = [int(w) for w in a.widths.split(",")]
    res = run(a.device, dtype, widths, a.tiny, a.iters, a.rounds, a.context)
    for r in res["rows"]:
        print(f"{r['forward']:>16} q={r['q']:<3} {r['ms_per_step']:8.3f} ms/step")
    print(f"targets (argmax) of the two forwards at q={max(widths)}: {res['argmax_agree']} agree")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
