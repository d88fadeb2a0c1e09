"""Summarise a bench_attention.py JSON: medians side by side, ratios against the targets.

python bench/report.py runs/bench_attention.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    data = json.load(open(path))
    rows: dict = defaultdict(dict)
    matmul: dict = {}
    for b in data["benchmarks"]:
        e = b["extra_info"]
        if e.get("impl") == "matmul":
            matmul[e["dtype"]] = e["gflops"]
            continue
        key = (e["dtype"], e["variant"], e["mode"], e["seq_len"])
        rows[key][e["impl"]] = (b["stats"]["median"] * 1e3, e["gflops"], e["peak_extra_mib"])
    print("matmul GFLOP/s (same run): " + ", ".join(f"{k} {v:.0f}" for k, v in matmul.items()))
    impls = ["jacobi", "sdpa_dense", "two_pass", "flex"]
    head = "dtype variant        mode    S    " + "".join(f"{i:>24}" for i in impls)
    print(head + "   vs dense  vs 2-pass  %matmul")
    for key in sorted(rows):
        dtype, variant, mode, S = key
        r = rows[key]
        cells = "".join(
            f"{r[i][0]:8.1f}ms {r[i][1]:4.0f}GF {r[i][2] or 0:5.0f}MiB".rjust(24)
            if i in r
            else f"{'-':>24}"
            for i in impls
        )
        ours = r.get("jacobi")
        vs_dense = (
            f"{r['sdpa_dense'][0] / ours[0]:8.2f}x" if ours and "sdpa_dense" in r else "       -"
        )
        vs_two = f"{r['two_pass'][0] / ours[0]:9.2f}x" if ours and "two_pass" in r else "        -"
        pct = f"{100 * ours[1] / matmul[dtype]:7.0f}%" if ours and dtype in matmul else "       -"
        print(f"{dtype:5} {variant:14} {mode:6} {S:5}{cells} {vs_dense} {vs_two} {pct}")
    print("targets (fp32, S=4096, fwdbwd): >= 3.5x vs dense, >= 1.3x vs 2-pass, >= 50% of matmul")


if __name__ == "__main__":
    main(sys.argv[1])
