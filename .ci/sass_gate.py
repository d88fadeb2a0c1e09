"""The SASS gate of the sm_90a attention objects: reads the machine code that ptxas made for
sm_90a and fails loudly where a Hopper kernel would be slow in a way no CPU test sees.

Checks, over every function of the sm_90a objects given (the jacobi_cuda_sm90 object library,
and jacobi_cuda_decode's sm_90a code):
  - every Hopper attention kernel (HOPPER_KERNELS) exists, uses warpgroup MMAs (HGMMA > 0) and no
    Ampere-style MMAs (HMMA = 0);
  - no function uses local memory (LDL/STL: register spills or stack arrays);
  - no HMMA anywhere in these objects (sm_80 code belongs in the sm_80 kernels);
  - every function is listed, in HOPPER_KERNELS or OTHER_KERNELS, so that a new Hopper kernel
    cannot slip past the HGMMA check unlisted;
  - with --build-log: no ptxas warning that wgmma instructions were serialized.
Were HOPPER_KERNELS empty, the HGMMA check would have nothing to check; the gate says so in its
output, and --require-hopper-kernels (which .ci/cuda_compile_check.sh passes) makes it a failure.

The SASS comes from cuobjdump (pip wheel nvidia-cuda-cuobjdump; requirements/sass-gate.txt).

usage: python .ci/sass_gate.py OBJ_OR_DIR... [--build-log LOG] [--cuobjdump PATH]
                               [--require-hopper-kernels]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Substrings of the (mangled) names of the Hopper attention kernels: each must match at least one
# sm_90a function, and every function it matches must use HGMMA and no HMMA: the forward
# (csrc/cuda/attention/sm90/fwd_sm90.h) and the backward (bwd_sm90.h).
HOPPER_KERNELS: list[str] = ["fwd_sm90_kernel", "bwd_sm90_kernel"]
# Other sm_90a functions, allowed without HGMMA (still no HMMA, no LDL/STL).
OTHER_KERNELS: list[str] = [
    "expand_tile_lists_kernel",  # the tile-list consumer of the debug op (attention_sm90.cu)
    "bwd_sm90_prep_kernel",  # the backward's lse / delta preprocessing (attention_sm90.cu)
    "bwd_sm90_dq_convert_kernel",  # the backward's dQ scale + scatter (attention_sm90.cu)
    # the decode step's fused small ops (csrc/cuda/decode_cuda.cu, object library
    # jacobi_cuda_decode): fp32 CUDA-core code, no MMA of either kind
    "rms_norm_kernel",
    "silu_mul_kernel",
    "rope_attention_kernel",
    "combine_kernel",
    "kv_commit_kernel",
    "argmax_kernel",
]
ARCH = "sm_90a"
WGMMA_SERIALIZED = re.compile(r"wgmma.*serializ", re.IGNORECASE)

FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
ARCH_LINE = re.compile(r"^\s*(?:arch = |\.target\s+|code for )(sm_\w+)")
# An instruction line: /*0040*/  [@P0] OPCODE.MODIFIERS operands ;
INSTR = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.\S*)?\s")
COUNTED = ("HGMMA", "HMMA", "LDL", "STL")


@dataclass
class Function:
    name: str
    arch: str
    source: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTED, 0))
    instructions: int = 0


def parse_sass(text: str, source: str = "") -> list[Function]:
    """cuobjdump -sass output -> the functions in it, with their opcode counts."""
    functions: list[Function] = []
    arch = ""
    cur: Function | None = None
    for line in text.splitlines():
        if m := ARCH_LINE.match(line):
            arch = m[1]
            continue
        if m := FUNCTION.match(line):
            cur = Function(m[1], arch, source)
            functions.append(cur)
            continue
        if cur is not None and (m := INSTR.match(line)):
            cur.instructions += 1
            op = m[1]
            if op in cur.counts:
                cur.counts[op] += 1
    return functions


def find_cuobjdump(explicit: str | None) -> str:
    candidates = [explicit, os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    cuda = os.environ.get("CUDA_PATH") or os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    candidates.append(os.path.join(cuda, "bin", "cuobjdump"))
    try:  # the pip wheel: nvidia/cu13/bin/cuobjdump (or nvidia/cuda_cuobjdump/bin for CUDA 12)
        import nvidia  # type: ignore[import-not-found]

        for root in nvidia.__path__:
            candidates += [str(p) for p in Path(root).glob("*/bin/cuobjdump")]
    except ImportError:
        pass
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise SystemExit(
        "sass_gate: FAIL: no cuobjdump found (looked at --cuobjdump, $CUOBJDUMP, PATH, "
        f"{cuda}/bin and the nvidia-cuda-cuobjdump wheel); "
        "pip install -r requirements/sass-gate.txt"
    )


def objects_of(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(x for x in p.rglob("*") if x.suffix in (".o", ".cubin", ".so"))
        elif p.is_file():
            out.append(p)
        else:
            raise SystemExit(f"sass_gate: FAIL: {p} does not exist (was the sm_90a library built?)")
    return out


def check(functions: list[Function], log_text: str | None, require_hopper: bool) -> list[str]:
    """The gate's verdicts: a list of failures (empty: pass). Prints what it checked."""
    bad: list[str] = []
    sm90 = [f for f in functions if f.arch == ARCH]
    if not sm90:
        return [f"no {ARCH} function in the objects (were they compiled for {ARCH}?)"]
    for f in sm90:
        short = f.name[-90:]
        hopper = any(k in f.name for k in HOPPER_KERNELS)
        other = any(k in f.name for k in OTHER_KERNELS)
        if not (hopper or other):
            bad.append(
                f"{short}: not listed in .ci/sass_gate.py (HOPPER_KERNELS if it must use "
                "wgmma, OTHER_KERNELS otherwise)"
            )
        if f.counts["LDL"] or f.counts["STL"]:
            bad.append(
                f"{short}: local memory (LDL {f.counts['LDL']}, STL {f.counts['STL']}): spills or "
                "a stack array"
            )
        if f.counts["HMMA"]:
            bad.append(f"{short}: {f.counts['HMMA']} HMMA (Ampere MMA) in sm_90a code")
        if hopper and not f.counts["HGMMA"]:
            bad.append(f"{short}: a Hopper kernel without HGMMA (wgmma was not used)")
    for k in HOPPER_KERNELS:
        if not any(k in f.name for f in sm90):
            bad.append(f"Hopper kernel '{k}' (HOPPER_KERNELS) is not in the {ARCH} objects")
    if not HOPPER_KERNELS:
        msg = (
            "HGMMA check: HOPPER_KERNELS is empty (no Hopper attention kernel is listed): "
            "NOTHING WAS CHECKED for HGMMA; the other checks ran"
        )
        if require_hopper:
            bad.append(msg)
        else:
            print(f"sass_gate: NOTICE: {msg}")
    if log_text is not None:
        lines = [ln.strip() for ln in log_text.splitlines() if WGMMA_SERIALIZED.search(ln)]
        bad += [f"ptxas: {ln}" for ln in lines]
        print(f"sass_gate: build log: {len(lines)} 'wgmma serialized' warning(s)")
    for f in sm90:
        kind = "hopper" if any(k in f.name for k in HOPPER_KERNELS) else "other"
        c = f.counts
        print(
            f"  {f.arch:7} {kind:6} HGMMA {c['HGMMA']:4d} HMMA {c['HMMA']:4d} LDL {c['LDL']:3d} "
            f"STL {c['STL']:3d} ({f.instructions} instr) {f.name[-80:]}"
        )
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("objects", nargs="+", help="sm_90a object files, or folders to search")
    ap.add_argument("--build-log", help="the build log with ptxas's output")
    ap.add_argument("--cuobjdump")
    ap.add_argument("--require-hopper-kernels", action="store_true")
    ap.add_argument(
        "--hopper-kernel", action="append", default=[], help="add to HOPPER_KERNELS (self-tests)"
    )
    ap.add_argument(
        "--other-kernel", action="append", default=[], help="add to OTHER_KERNELS (self-tests)"
    )
    args = ap.parse_args()
    HOPPER_KERNELS.extend(args.hopper_kernel)
    OTHER_KERNELS.extend(args.other_kernel)
    tool = find_cuobjdump(args.cuobjdump)
    objs = objects_of(args.objects)
    if not objs:
        print(f"sass_gate: FAIL: no object files in {args.objects}")
        return 1
    functions: list[Function] = []
    for obj in objs:
        r = subprocess.run([tool, "-sass", str(obj)], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"sass_gate: FAIL: {tool} -sass {obj}: {r.stderr.strip()}")
            return 1
        functions += parse_sass(r.stdout, str(obj))
    log_text = None
    if args.build_log:
        log_text = Path(args.build_log).read_text(encoding="utf-8", errors="replace")
    print(
        f"sass_gate: {len(objs)} object(s), {sum(f.arch == ARCH for f in functions)} {ARCH} "
        f"function(s), cuobjdump {tool}"
    )
    bad = check(functions, log_text, args.require_hopper_kernels)
    for b in bad:
        print(f"sass_gate: FAIL: {b}")
    print("sass_gate: " + ("FAILED" if bad else "passed"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
