#!/usr/bin/env python3
"""Fails if jacobi_ext's _C exports any std:: symbol, or carries libstdc++'s own code.

Why: a build made on a GPU machine died of SIGSEGV where CI's raised ValueError: inside _C,
std::ostream::_M_insert<long> (formatting an integer into an argument check's message) called
codecvt<char16_t>::do_unshift, both in _C.so; a copy of libstdc++'s stream code linked into _C
looked up the shared libstdc++'s locale facets with its own facet ids and got the wrong facet.
_C must use the shared libstdc++ alone (CMakeLists.txt, csrc/torch/_C.map). Two checks:

1. exports (`nm -D --defined-only`): _C exports no symbol the shared libstdc++ defines and no
   std:: symbol at all (the version script leaves PyInit__C); an exported copy of a libstdc++
   function can be bound by the dynamic linker in place of the library's.
2. copies (`nm -C --defined-only`, where _C still has its symbol table: the build folder's _C,
   not the stripped one pip installs): no strong (T/D/B/R) definition of a symbol that the
   shared libstdc++ exports. Code the compiler instantiates from libstdc++'s headers is always
   weak (W/V/u: one copy per program, by the ODR); a strong one is object code of libstdc++
   itself (libstdc++.a, -static-libstdc++, or a toolchain's libstdc++_nonshared.a).

    python .ci/check_cxx_runtime.py [PATH_TO_C_SO ...]   (default: the installed jacobi_ext's _C
                                                           and any _C*.so under build/)
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

STRONG = set("TDBR")


def _nm(args: list[str], path: str) -> list[tuple[str, str]]:
    """(type letter, name) of every defined symbol nm lists; [] where there is no symbol table."""
    out = subprocess.run(["nm", *args, "--defined-only", path], capture_output=True, text=True)
    if out.returncode != 0:
        if "no symbols" in out.stderr:
            return []
        raise SystemExit(f"nm {' '.join(args)} {path} failed: {out.stderr.strip()}")
    rows = []
    for line in out.stdout.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3:
            rows.append((parts[1], parts[2]))
    return rows


def _libstdcxx(path: str) -> str | None:
    """The libstdc++.so.6 that `path` loads (ldd)."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    m = re.search(r"libstdc\+\+\.so\.6 => (\S+)", out)
    return m.group(1) if m else None


def check(path: str) -> list[str]:
    problems = []
    lib = _libstdcxx(path)
    ref = lib or _compilers_libstdcxx()  # linked statically: compare with the compiler's
    theirs = {n.split("@")[0] for _, n in _nm(["-D"], ref)} if ref else set()
    exported = [n for _, n in _nm(["-D"], path)]
    shared = sorted(set(exported) & theirs)
    std = sorted(n for n in _demangle(exported) if n.startswith("std::"))
    if shared or std:
        names = _demangle(shared[:5]) + std[:5]
        problems.append(
            f"exports {len(shared)} symbols libstdc++ defines and {len(std)} std:: ones, e.g. "
            + "; ".join(names[:5])
        )
    symtab = _nm([], path)
    if not symtab:
        print(f"{path}: no symbol table (stripped): export check only")
    if lib is None:
        problems.append("links no shared libstdc++.so.6 (ldd): is libstdc++ linked statically?")
    if symtab and theirs:
        copies = sorted(n for t, n in symtab if t in STRONG and n in theirs)
        if copies:
            problems.append(
                f"defines {len(copies)} symbols of {ref} strongly (libstdc++'s own code linked "
                "in), e.g. " + "; ".join(_demangle(copies[:5]))
            )
    print(f"{path}: {len(exported)} exported symbols, libstdc++ {lib}")
    return problems


def _compilers_libstdcxx() -> str | None:
    out = subprocess.run(["c++", "-print-file-name=libstdc++.so.6"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def _demangle(names: list[str]) -> list[str]:
    if not names:
        return []
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return out.stdout.splitlines()


def main(argv: list[str]) -> int:
    paths = argv or _default_paths()
    if not paths:
        print("no _C*.so found (pass its path)", file=sys.stderr)
        return 2
    bad = 0
    for p in paths:
        problems = check(p)
        for msg in problems:
            print(f"FAIL {p}: {msg}")
        if not problems:
            print(f"ok {p}: exports PyInit__C alone; no libstdc++ code of its own")
        bad += bool(problems)
    return 1 if bad else 0


def _default_paths() -> list[str]:
    paths = sorted(glob.glob("build/**/_C*.so", recursive=True))
    code = "import importlib.util as u, os; s = u.find_spec('jacobi_ext'); print(s.origin)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd="/"
    ).stdout.strip()
    if out:
        paths += glob.glob(os.path.join(os.path.dirname(out), "_C*.so"))
    return paths


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
