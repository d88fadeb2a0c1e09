"""Answer checkers for evaluation on any prompt file (``jacobi-forcing eval --prompts FILE``).

A row of a prompt file is checked by one of

- ``tests``: Python run after the code of the model's answer (its first fenced block with a
  ``def``, as for HumanEval) in the sandboxed subprocess of ``execution.run_program``; with an
  ``entry_point``, ``check(<entry_point>)`` is called after the tests, HumanEval's convention.
  Passed means the program exited 0: pass@1.
- ``answer``: exact match of the final answer, extracted from the model's output by the
  conventions math sets use (``extract_answer``: the text after the last ``####``, else the last
  ``\\boxed{...}``, else the last number), against the row's ``answer`` (a number, or a string:
  a GSM8K solution ending in ``#### N`` or a MATH one with ``\\boxed{}`` gives its final answer
  the same way, any other string is the answer itself). Both sides are normalised
  (``normalize_answer``): numbers compare by value (``1,000`` = ``1000.0`` = ``$1000`` and
  ``\\frac{1}{2}`` = ``0.5``), other strings after removing spaces and a little LaTeX.
- ``none``: nothing is checked; the row gives TPF and speed only.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

CHECKERS = ("tests", "answer", "none")
# How the table names each checker's accuracy.
MEASURES = {"tests": "pass@1", "answer": "exact match"}

# A number as written in an answer: thousands commas only in groups of three, an optional
# decimal part; a minus sign counts only where it is not a subtraction (after a word or digit).
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])-?\.\d+")
_LEADING_NUMBER = re.compile(r"\s*\\?\$?\s*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+)")
_FRAC = re.compile(r"^\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$|^(-?\d+)/(-?\d+)$")


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed: the answer was cut off


def _after_hashes(text: str) -> str:
    """What follows the last ``####`` on its line: the number it starts with, else the rest."""
    seg = text[text.rfind("####") + 4 :].split("\n", 1)[0]
    m = _LEADING_NUMBER.match(seg)
    return m.group(1) if m else seg.strip()


def extract_answer(text: str) -> str | None:
    """The final answer of a model's output: after the last ``####`` (GSM8K), else in the last
    ``\\boxed{}`` (MATH), else the last number; None if there is none."""
    if "####" in text:
        seg = _after_hashes(text)
        if seg:
            return seg
    boxed = _boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def reference_answer(answer: str | int | float) -> str:
    """The final answer a row's ``answer`` field gives: a number as it is; a string holding a
    worked solution (``#### N`` or ``\\boxed{}``) its final answer; any other string itself."""
    if not isinstance(answer, str):
        return str(answer)
    if "####" in answer:
        return _after_hashes(answer)
    boxed = _boxed(answer)
    return boxed.strip() if boxed is not None else answer.strip()


def _number(s: str) -> Fraction | None:
    s = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    m = _FRAC.match(s)
    if m:
        a, b = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
        return Fraction(int(a), int(b)) if int(b) else None
    if not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
        return None
    try:
        return Fraction(Decimal(s))
    except (InvalidOperation, ValueError):
        return None


def normalize_answer(s: str) -> str:
    """A canonical form: numbers by value (``1,000`` / ``1000.0`` / ``$1000`` -> ``1000``,
    ``\\frac{1}{2}`` / ``0.5`` -> ``1/2``), other strings without spaces, ``$``, ``%``,
    ``\\left`` / ``\\right``, ``\\!`` and a ``\\text{}`` wrapper, and with ``\\dfrac`` /
    ``\\tfrac`` as ``\\frac``."""
    t = s.strip()
    t = re.sub(r"^\\text\{(.*)\}$", r"\1", t)
    for a, b in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""),
                 ("\\$", ""), ("$", ""), ("\\%", ""), ("%", ""), ("\\dfrac", "\\frac"),
                 ("\\tfrac", "\\frac")):  # fmt: skip
        t = t.replace(a, b)
    t = re.sub(r"\s+", "", t).rstrip(".")
    n = _number(t)
    if n is None:
        return t
    return str(n.numerator) if n.denominator == 1 else f"{n.numerator}/{n.denominator}"


def check_answer(expected: str | int | float, output: str) -> tuple[bool, str]:
    """(passed, why) of the ``answer`` checker."""
    want = reference_answer(expected)
    got = extract_answer(output)
    if got is None:
        return False, f"no answer found (expected {want})"
    ok = normalize_answer(got) == normalize_answer(want)
    shown = got if len(got) <= 60 else got[:57] + "..."  # e.g. a degenerate loop of digits
    return ok, f"answer {shown}" + ("" if ok else f" (expected {want})")


def build_tests_program(tests: str, answer: str, entry_point: str | None = None) -> str:
    """The program of the ``tests`` checker: the answer's code, the tests, and
    ``check(entry_point)`` where the row names one."""
    from .execution import extract_code

    call = f"\n\ncheck({entry_point})\n" if entry_point else "\n"
    return f"{extract_code(answer)}\n\n{tests}{call}"


def check_row(row: dict, output: str, timeout: float = 10.0) -> tuple[str | None, bool | None, str]:
    """(checker, passed, why) of a problem (a HumanEval problem or a prompt file's row) and the
    model's output. HumanEval problems (``test`` and ``entry_point``) run their tests; a prompt
    file's row is checked by its ``checker``; None passed where nothing was checked."""
    from .execution import check_completion, run_program

    checker = row.get("checker")
    if checker is None and "test" in row:  # a HumanEval problem
        return ("tests", *check_completion(row, output, timeout))
    if checker == "tests":
        program = build_tests_program(row["tests"], output, row.get("entry_point"))
        return ("tests", *run_program(program, timeout))
    if checker == "answer":
        return ("answer", *check_answer(row["answer"], output))
    return None, None, "no checker"
