"""pass@1 for HumanEval: extract the code from a chat answer, run the problem's tests in a
subprocess with a timeout, no network and a fresh temporary directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.S)

# Run before the program: no sockets (no network), no subprocesses spawned by the completion.
_GUARD = """\
import socket as _s
def _no_net(*a, **k):
    raise OSError("network disabled in HumanEval execution")
_s.socket = _no_net
_s.create_connection = _no_net
_s.getaddrinfo = _no_net
import resource as _r
_r.setrlimit(_r.RLIMIT_AS, (2 << 30, 2 << 30))
del _s, _r
"""


def extract_code(answer: str) -> str:
    """The first fenced code block that contains a ``def`` (else the first block, else the
    whole answer)."""
    blocks = _FENCE.findall(answer)
    for b in blocks:
        if re.search(r"^\s*def\s", b, re.M):
            return b
    return blocks[0] if blocks else answer


def build_program(problem: dict, answer: str) -> str:
    """The problem's prompt (imports, helpers and a docstring-only stub of the entry point),
    then the answer's code (a complete function redefines the stub; a bare body is appended to
    the prompt as HumanEval's own harness does), then the tests and ``check(entry_point)``."""
    code = extract_code(answer)
    entry = problem["entry_point"]
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M):
        body = problem["prompt"] + "\n    pass\n\n" + code
    else:
        body = problem["prompt"] + code
    return f"{body}\n\n{problem['test']}\n\ncheck({entry})\n"


def run_program(program: str, timeout: float = 10.0) -> tuple[bool, str]:
    """(passed, reason) of running ``program`` in an isolated Python subprocess."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "prog.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(_GUARD + program)
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0", "HOME": d}
        try:
            r = subprocess.run(
                [sys.executable, "-I", path],
                cwd=d,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return False, "timeout"
    if r.returncode == 0:
        return True, "passed"
    err = (r.stderr.strip().splitlines() or ["failed"])[-1]
    return False, err[:200]


def check_completion(problem: dict, answer: str, timeout: float = 10.0) -> tuple[bool, str]:
    return run_program(build_program(problem, answer), timeout)
