"""Reads a build log with nvcc's `-Xptxas -v` report; fails on any register spill or stack use
from spills, and summarises the kernels per architecture.

usage: python .ci/check_ptxas.py BUILD_LOG [--require-arch sm_80 --require-arch sm_90a]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict

ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)' for '(?P<arch>sm_\w+)'")
SPILL = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, "
    r"(?P<ld>\d+) bytes spill loads"
)
REGS = re.compile(r"Used (?P<regs>\d+) registers")


def parse(text: str) -> list[dict]:
    kernels: list[dict] = []
    cur: dict | None = None
    for line in text.splitlines():
        if m := ENTRY.search(line):
            cur = {
                "name": m["name"],
                "arch": m["arch"],
                "spill_st": None,
                "spill_ld": None,
                "regs": None,
                "stack": None,
            }
            kernels.append(cur)
        elif cur is not None and (m := SPILL.search(line)):
            cur.update(stack=int(m["stack"]), spill_st=int(m["st"]), spill_ld=int(m["ld"]))
        elif cur is not None and (m := REGS.search(line)):
            cur["regs"] = int(m["regs"])
    return kernels


def short_name(mangled: str) -> str:
    """A readable label for this repo's kernels: name<element, template ints, flags>."""
    name = mangled[:60]
    for m in re.finditer(r"(?<!\d)(\d+)(?=[A-Za-z_])", mangled):  # <length><identifier>
        ident = mangled[m.end() : m.end() + int(m[1])]
        if ident.endswith("kernel"):
            name = ident
            break
    elem = "bf16" if "bfloat16" in mangled else ("fp16" if "half_t" in mangled else "")
    ints = re.findall(r"Li(\d+)E", mangled)
    flags = re.findall(r"Lb([01])E", mangled)
    args = ",".join(x for x in [elem, *ints, *(f"b{f}" for f in flags)] if x)
    return f"{name}<{args}>" if args else name


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--require-arch", action="append", default=[])
    ap.add_argument("--table", action="store_true", help="print registers/spills per kernel")
    args = ap.parse_args()
    text = open(args.log, encoding="utf-8", errors="replace").read()
    kernels = parse(text)
    if not kernels:
        print(f"check_ptxas: no ptxas report in {args.log} (was -Xptxas -v lost?)")
        return 1
    per_arch: dict[str, int] = defaultdict(int)
    bad = []
    for k in kernels:
        per_arch[k["arch"]] += 1
        if k["spill_st"] is None:
            bad.append(f"{k['arch']} {k['name']}: no spill line in the report")
        elif k["spill_st"] or k["spill_ld"]:
            bad.append(
                f"{k['arch']} {k['name']}: {k['spill_st']} B spill stores, "
                f"{k['spill_ld']} B spill loads, {k['regs']} registers"
            )
    for arch in args.require_arch:
        if per_arch.get(arch, 0) == 0:
            bad.append(f"no kernel compiled for {arch}")
    print(
        f"check_ptxas: {len(kernels)} kernel entries, "
        + ", ".join(f"{a}: {c}" for a, c in sorted(per_arch.items()))
        + f"; max registers {max((k['regs'] or 0) for k in kernels)}; "
        f"report {sum(1 for line in text.splitlines() if 'ptxas' in line)} lines"
    )
    if args.table:
        rows = sorted(kernels, key=lambda k: (short_name(k["name"]), k["arch"]))
        for k in rows:
            print(
                f"  {k['arch']:7} {k['regs'] or 0:4d} regs  spill {k['spill_st'] or 0}/"
                f"{k['spill_ld'] or 0} B  {short_name(k['name'])}"
            )
    for b in bad:
        print("check_ptxas: FAIL", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
