"""pass@1 execution: a correct completion passes, a wrong one fails, a hanging one times out,
and the network is unreachable from the test process."""

from __future__ import annotations

import time

from jacobi_ext.data import load_humaneval
from python_training.execution import build_program, check_completion, extract_code, run_program


def problem():
    return load_humaneval(1)[0]  # has_close_elements


def test_correct_full_function_and_body_pass():
    p = problem()
    answer = "Here it is:\n```python\n" + p["prompt"] + p["canonical_solution"] + "```\nDone."
    assert check_completion(p, answer) == (True, "passed")
    body_only = "```python\n" + p["canonical_solution"] + "```"
    assert check_completion(p, body_only)[0]


def test_incorrect_completion_fails():
    p = problem()
    wrong = (
        "```python\nfrom typing import List\n\n"
        "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
        "    return False\n```"
    )
    ok, why = check_completion(p, wrong)
    assert not ok and "AssertionError" in why


def test_timeout_is_respected():
    p = problem()
    loop = (
        "```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```"
    )
    t = time.perf_counter()
    assert check_completion(p, loop, timeout=2.0) == (False, "timeout")
    # Killed at its timeout, not waited for (the loop never ends): a bound far above the 2 s, so
    # that a loaded machine's slow process start does not fail the test.
    assert time.perf_counter() - t < 60


def test_no_network_and_code_extraction():
    ok, why = run_program("import socket\nsocket.create_connection(('127.0.0.1', 9))\n")
    assert not ok and "network disabled" in why
    assert extract_code("a\n```\nx = 1\n```\n```python\ndef f():\n  pass\n```") == (
        "def f():\n  pass\n"
    )
    assert "check(has_close_elements)" in build_program(problem(), "```python\npass\n```")
