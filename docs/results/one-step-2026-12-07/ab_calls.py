"""Whole generate calls of the shipped model (smollm2-jf on the default model's Q4_1 codes), for
an A/B of two builds of jacobi_ext run in alternating processes: `ar` and the tuned default,
exact and on 8-bit activations, the first N HumanEval prompts in the chat form the benchmark's
rows use (jacobi_ext.data.humaneval_input_ids), whole calls (prefill included). Prints one JSON
line: per row, tokens/s over all prompts and the tokens themselves (the two builds must give the
same).

    python ab_calls.py --prompts 4 --new 64 > run.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()

    import jacobi_ext
    from jacobi_ext.data import humaneval_input_ids, load_humaneval
    from jacobi_ext.models import load_model

    probs = load_humaneval(limit=args.prompts)
    out = {"jacobi_ext": jacobi_ext.__file__, "rows": {}}
    for mode, int8 in (("exact", False), ("8-bit", True)):
        model, tok = load_model("smollm2-jf", int8_activations=int8)
        ids = [humaneval_input_ids(tok, p) for p in probs]
        for row, kw in (("ar", dict(method="ar")), ("tuned", {})):
            jacobi_ext.generate(model, ids[0], max_new_tokens=8, **kw)  # warm (tuner, packing)
            n, toks, t0 = 0, [], time.perf_counter()
            for x in ids:
                r = jacobi_ext.generate(model, x, max_new_tokens=args.new, **kw)
                n += int(r.lengths[0])
                toks.append(r.tokens[0].tolist())
            dt = time.perf_counter() - t0
            out["rows"][f"{row} [{mode}]"] = {"tokens_per_s": n / dt, "tokens": toks}
    print(json.dumps(out))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
