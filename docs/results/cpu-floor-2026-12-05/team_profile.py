"""Per posted job of the CPU team (csrc/cpu/team.h), where the threads' time goes: the 'cycle-
counted build' of the third session (2026-12-05). Not part of the product.

  git apply docs/results/cpu-floor-2026-12-05/team_profile.patch   # counters in team.cpp
  cmake --build build/<wheel tag> && cp build/<wheel tag>/_C*.so <site-packages>/jacobi_ext/
  python <a script that runs steps> 2> prof.txt                     # printed at exit
  python team_profile.py prof.txt build/<wheel tag>/_C*.so STEPS [TSC_GHZ]

Each line: a parallel_for call site (its trampoline, resolved with nm), calls a step, and per
call in us: the first thread's chunk, its wait for the others, the others' chunk, the time since
the last job ended (the first thread's serial work, the others idle) and of it the op's own
prologue (from LeanLayers' call of the op to the post). STEPS: the steps the script ran (the
counters also hold its warm-up). TSC_GHZ: the time-stamp counter's rate (2.596 on the 2-core EPYC,
its BogoMIPS / 2)."""

import bisect
import re
import subprocess
import sys


def main(prof: str, lib: str, steps: int, ghz: float) -> None:
    syms = []
    for line in subprocess.run(["nm", "-C", "--defined-only", lib], capture_output=True,
                               text=True, check=True).stdout.splitlines():  # fmt: skip
        addr, _, rest = line.partition(" ")
        try:
            syms.append((int(addr, 16), rest.partition(" ")[2]))
        except ValueError:
            continue
    syms.sort()
    addrs = [a for a, _ in syms]
    for line in open(prof):
        if not line.startswith("TEAMPROF"):
            continue
        vals = dict(re.findall(r"(\w+)=([0-9a-f.]+)", line))
        n = int(vals["n"])
        name = syms[bisect.bisect_right(addrs, int(vals["off"], 16)) - 1][1]
        name = re.sub(r"jacobi::cpu::\w+::\(anonymous namespace\)::", "", name)

        def us(key: str, vals: dict = vals, n: int = n) -> float:  # Mticks, all calls -> us a call
            return float(vals.get(key, 0)) * 1e6 / n / (ghz * 1e3)

        print(f"{n / steps:6.0f}/step  chunk {us('lead_chunk'):7.2f} wait {us('lead_wait'):6.2f} "
              f"other {us('work_chunk'):7.2f} gap {us('gap_before'):6.2f} "
              f"prologue {us('prologue'):6.2f}  {name[:110]}")  # fmt: skip


if __name__ == "__main__":
    ghz = float(sys.argv[4]) if len(sys.argv) > 4 else 2.596
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), ghz)
