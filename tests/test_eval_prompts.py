"""`eval --prompts FILE.jsonl`: any JSONL prompt file, plain prompts and chats, an
answer checker per line or per file (``tests``: the sandboxed Python run, pass@1; ``answer``:
the final answer by math-set conventions; ``none``), clear errors naming the line and the field,
and the same lossless rows and table as for HumanEval."""

from __future__ import annotations

import gzip
import json

import pytest

from python_training import evaluate as ev
from python_training.checkers import (
    check_answer,
    check_row,
    extract_answer,
    normalize_answer,
    reference_answer,
)

# What the patched tokenizer "decodes" every answer to (the random model's own text is noise):
# a Python function in a fence, then a GSM8K-style final answer.
CANNED = "Sure.\n```python\ndef add(a, b):\n    return a + b\n```\nSo 600 + 400 = 1000.\n#### 1,000"

ROWS = [
    {"id": "add", "prompt": "Write add(a, b).", "tests": "assert add(2, 3) == 5"},
    {
        "id": "add-check",
        "prompt": "Write add.",
        "entry_point": "add",
        "tests": "def check(f):\n    assert f(1, 1) == 2\n",
    },  # fmt: skip
    {"id": "sum", "question": "What is 600 + 400?", "answer": "600 + 400 = 1000\n#### 1000"},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "How much is 2 + 5?"},
        ],
        "answer": 7,
    },  # fmt: skip
    {"id": 5, "prompt": "Tell me a story.", "meta": {"source": "mine"}},
]


def write_jsonl(path, rows, extra: str = ""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)
    return path


# --- the answer checker -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, want",
    [
        ("He pays 3 * 4 = 12 dollars.\n#### 12", "12"),
        ("#### $1,000.", "1,000"),
        ("so #### 5 apples, then #### 7 pears", "7"),  # the last ####, its leading number
        ("The area is \\boxed{\\frac{1}{2}} square units.", "\\frac{1}{2}"),
        ("first \\boxed{3} then \\boxed{x^{2}+1}", "x^{2}+1"),
        ("It costs 1,250 in 2 days, so 625 a day.", "625"),
        ("5-3 is 2", "2"),
        ("The temperature is -4.5 degrees.", "-4.5"),
        ("no digits here", None),
        ("cut off \\boxed{12", "12"),  # an unclosed box: the last number
    ],
)
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_normalized_numbers_and_strings():
    for a in ("1,000", "1000.0", "$1000", "1000", "\\$1,000.00", " 1000. "):
        assert normalize_answer(a) == "1000", a
    assert normalize_answer("\\frac{1}{2}") == normalize_answer("0.5") == "1/2"
    assert normalize_answer("\\dfrac{3}{6}") == "1/2" and normalize_answer("-2/4") == "-1/2"
    assert normalize_answer("50\\%") == "50"
    assert normalize_answer("\\left( 3, 4 \\right)") == "(3,4)"
    assert normalize_answer("\\text{east}") == "east"
    assert normalize_answer("1,2,3") == "1,2,3"  # not a thousands-separated number


def test_reference_answers_and_check_answer():
    assert reference_answer("Natalia sold 48/2 = 24 clips in May.\n#### 72") == "72"
    assert reference_answer("so the answer is $\\boxed{\\dfrac{1}{4}}$.") == "\\dfrac{1}{4}"
    assert reference_answer(" 3.50 ") == "3.50" and reference_answer(18) == "18"
    assert check_answer(1000, CANNED) == (True, "answer 1,000")
    assert check_answer("#### 1000.0", CANNED)[0]
    assert check_answer(0.25, "so \\boxed{\\frac{1}{4}}")[0]
    assert check_answer("x^2+1", "\\boxed{x^{2} + 1}") == (
        False,
        "answer x^{2} + 1 (expected x^2+1)",
    )
    assert check_answer("7", "I do not know") == (False, "no answer found (expected 7)")
    assert check_answer(7, "2 + 5 = 7, not 8") == (False, "answer 8 (expected 7)")
    assert check_answer(7, "0" * 200) == (False, "answer " + "0" * 57 + "... (expected 7)")


# --- the tests checker (the sandboxed subprocess) ------------------------------------------------


def test_tests_checker_runs_the_answer_against_the_tests():
    row = {"checker": "tests", "tests": "assert add(2, 3) == 5"}
    assert check_row(row, CANNED) == ("tests", True, "passed")
    row_fail = {"checker": "tests", "tests": "assert add(2, 3) == 6"}
    name, ok, why = check_row(row_fail, CANNED)
    assert name == "tests" and not ok and "AssertionError" in why
    row_check = {"checker": "tests", "entry_point": "add",
                 "tests": "def check(f):\n    assert f(1, 2) == 3\n"}  # fmt: skip
    assert check_row(row_check, CANNED)[1] is True
    loop = {"checker": "tests", "tests": "while True:\n    pass"}
    assert check_row(loop, CANNED, timeout=1.0) == ("tests", False, "timeout")
    net = {"checker": "tests", "tests": "import socket\nsocket.create_connection(('1.1.1.1', 53))"}
    assert "network disabled" in check_row(net, CANNED)[2]
    assert check_row({"checker": "none"}, CANNED) == (None, None, "no checker")


# --- reading a prompt file ----------------------------------------------------------------------


def test_read_prompt_file_rows(tmp_path):
    rows = ev.read_prompt_file(write_jsonl(tmp_path / "p.jsonl", ROWS, extra="\n  \n"))
    assert [r["checker"] for r in rows] == ["tests", "tests", "answer", "answer", "none"]
    assert rows[0]["task_id"] == "add" and rows[4]["task_id"] == "5"  # an integer id, as text
    assert rows[1]["entry_point"] == "add" and rows[2]["answer"].endswith("#### 1000")
    assert rows[2]["prompt"].chat() == [{"role": "user", "content": "What is 600 + 400?"}]
    assert rows[3]["prompt"].chat()[0]["role"] == "system"
    assert len(rows[3]["task_id"]) == 16  # no id: a hash of the chat, as collect's default
    again = ev.read_prompt_file(write_jsonl(tmp_path / "q.jsonl", ROWS[::-1]))
    assert {r["task_id"] for r in again} == {r["task_id"] for r in rows}  # order-independent
    # gzipped, and a checker for the whole file
    gz = tmp_path / "p.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp_path / "p.jsonl").read_bytes()))
    assert [r["checker"] for r in ev.read_prompt_file(gz, "none")] == ["none"] * 5
    both = [{"prompt": "x", "tests": "assert True", "answer": 1, "checker": "answer"}]
    assert ev.read_prompt_file(write_jsonl(tmp_path / "b.jsonl", both))[0]["checker"] == "answer"
    assert ev.read_prompt_file(tmp_path / "b.jsonl", "tests")[0]["tests"] == "assert True"
    # a per-row 'none' turns that row's check off
    off = [{"prompt": "x", "answer": 3, "checker": "none"}]
    assert ev.read_prompt_file(write_jsonl(tmp_path / "o.jsonl", off))[0]["checker"] == "none"


GOOD = json.dumps({"prompt": "ok"})
TURNS = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
ENDS_ANSWERED = json.dumps({"messages": TURNS})


@pytest.mark.parametrize(
    "line, match",
    [
        ("{not json", r":2: not a JSON object"),
        ('["a list"]', r":2: not a JSON object but a list"),
        ('{"prompt": "x", "answr": 3}', r":2: unknown field 'answr'.*'meta'"),
        ('{"id": "a"}', r":2: a line needs exactly one of the fields prompt, question"),
        ('{"prompt": "x", "messages": []}', r":2: .*exactly one.*not prompt and messages"),
        ('{"prompt": ""}', r":2: field 'prompt' must be a non-empty string"),
        ('{"question": 3}', r":2: field 'question' must be a non-empty string"),
        ('{"messages": "hi"}', r":2: field 'messages' must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}', r":2: field 'messages', turn 0"),
        (ENDS_ANSWERED, r":2: field 'messages' ends in an assistant turn"),
        ('{"prompt": "x", "answer": [1]}', r":2: field 'answer' must be a non-empty string or"),
        ('{"prompt": "x", "answer": true}', r":2: field 'answer'"),
        ('{"prompt": "x", "tests": 5}', r":2: field 'tests' must be a non-empty string"),
        ('{"prompt": "x", "entry_point": "f"}', r":2: field 'entry_point' needs a 'tests'"),
        ('{"prompt": "x", "tests": "pass", "entry_point": "a b"}', r":2: field 'entry_point'"),
        ('{"prompt": "x", "checker": "regex"}', r":2: field 'checker' must be one of"),
        ('{"prompt": "x", "checker": "answer"}', r":2: checker 'answer' .*needs a field 'answer'"),
        ('{"prompt": "x", "tests": "pass", "answer": 1}', r":2: the fields 'tests' and 'answer'"),
        ('{"prompt": "y", "id": ""}', r":2: field 'id' must be"),
        (
            '{"prompt": "y", "id": "a"}\n' + json.dumps({"prompt": "z", "id": "a"}),
            r":3: field 'id': 'a' is already line 2's",
        ),  # fmt: skip
        (GOOD, r":2: field 'id': '[0-9a-f]{16}' is already line 1's"),  # the same prompt twice
    ],
)
def test_bad_lines_name_the_line_and_the_field(tmp_path, line, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(GOOD + "\n" + line + "\n")
    with pytest.raises(ValueError, match=match) as e:
        ev.read_prompt_file(p)
    assert str(p) in str(e.value)


def test_file_checker_needs_its_field_and_empty_files_are_errors(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": "b"}])
    with pytest.raises(ValueError, match=r"p.jsonl:2: checker 'answer' \(--checker\) needs"):
        ev.read_prompt_file(p, "answer")
    for text in ("", "\n \n"):
        (tmp_path / "e.jsonl").write_text(text)
        with pytest.raises(ValueError, match=r"e.jsonl: no prompts"):
            ev.read_prompt_file(tmp_path / "e.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ev.read_prompt_file(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown checker"):
        ev.read_prompt_file(p, "regex")
    with pytest.raises(ValueError, match="or give a JSONL file"):
        ev._problems("gsm8k", None)


# --- evaluate on a prompt file, the table, the command line -------------------------------------


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama with SmolLM2's tokenizer (its chat template), as eval's own test."""
    from transformers import AutoTokenizer

    from jacobi_ext.models import default_model_file, tiny_llama

    path = default_model_file()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = tiny_llama(vocab_size=len(tok), eos_token_id=tok.eos_token_id, seed=1).eval()
    return model, tok


class CannedDecode:
    """The tokenizer, except that every answer decodes to CANNED (so checkers can pass)."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode(self, *a, **k):
        return CANNED


METHODS = ("greedy", "ar", "jacobi", "multiblock")


def test_eval_on_a_prompt_file(tiny, tmp_path):
    """Every checker, plain prompts and chats: the methods' outputs are identical to greedy's,
    each row names its checker, the summary and table give the accuracy per checker, --limit /
    --offset select lines, a rerun resumes."""
    model, tok = tiny
    prompts = write_jsonl(tmp_path / "mine.jsonl", ROWS)
    kw = dict(methods=METHODS, max_new_tokens=10, block_size=4, progress=False)
    res = tmp_path / "r.jsonl"
    s = ev.evaluate(model, CannedDecode(tok), res, prompts=str(prompts), **kw)
    assert set(s) == set(METHODS)
    for m, r in s.items():
        assert r["tasks"] == 5 and r["identical"] == 1.0, (m, r)
        # tests: both pass; answers: 1000 passes, 7 fails; the story is not checked
        assert r["accuracy"] == {"answer": {"checked": 2, "passed": 1, "rate": 0.5},
                                 "tests": {"checked": 2, "passed": 2, "rate": 1.0}}  # fmt: skip
        assert r["pass@1"] == 0.75
    rows = ev.read_results(res)
    assert len(rows) == 5 * len(METHODS)
    by = {r["task_id"]: r for r in rows if r["method"] == "jacobi"}
    assert by["add"]["checker"] == "tests" and by["add"]["passed"] is True
    assert by["sum"]["checker"] == "answer" and by["sum"]["result"] == "answer 1,000"
    assert by["5"]["checker"] is None and by["5"]["passed"] is None
    # the same columns as HumanEval's rows
    he_keys = {"task_id", "method", "label", "tokens", "forwards", "seconds", "passed", "result",
               "block_size", "completion", "token_ids", "settings", "sampling"}  # fmt: skip
    assert he_keys <= set(rows[0])
    table = ev.format_summary(s)
    assert "accuracy: exact match (answer), pass@1 (tests)" in table
    assert "| answer 50.0% of 2, tests 100.0% of 2 | yes |" in table
    # a rerun resumes: nothing is decoded twice
    ev.evaluate(model, CannedDecode(tok), res, prompts=str(prompts), **kw)
    assert len(ev.read_results(res)) == 5 * len(METHODS)

    # --offset / --limit pick lines; one checker for the file; the table names it
    ans = write_jsonl(tmp_path / "ans.jsonl", [r for r in ROWS if "answer" in r])
    s2 = ev.evaluate(model, CannedDecode(tok), tmp_path / "r2.jsonl", prompts=str(ans),
                     offset=1, limit=1, checker="answer", **kw)  # fmt: skip
    assert all(r["tasks"] == 1 and r["pass@1"] == 0.0 for r in s2.values())  # the 7 line
    t2 = ev.format_summary(s2)
    assert "accuracy: exact match (answer) |" in t2 and "| 0.0% | yes |" in t2
    s3 = ev.evaluate(model, CannedDecode(tok), tmp_path / "r3.jsonl", prompts=str(prompts),
                     limit=2, checker="none", **kw)  # fmt: skip
    assert all(r["pass@1"] is None and r["accuracy"] == {} for r in s3.values())
    assert "accuracy: none |" in ev.format_summary(s3)


def test_chat_and_plain_prompts_are_formatted_like_collect(tiny, tmp_path):
    """A prompt file's line becomes the ids its chat template gives (the same Prompt class as
    collect's), so `prompt`, `question` and a one-turn `messages` give the same ids."""
    _, tok = tiny
    from python_training.prompts import Prompt

    rows = [{"id": "a", "prompt": "What is 2 + 2?"}, {"id": "b", "question": "What is 2 + 2?"},
            {"id": "c", "messages": [{"role": "user", "content": "What is 2 + 2?"}]}]  # fmt: skip
    probs = ev._problems(str(write_jsonl(tmp_path / "c.jsonl", rows)), tok)
    want = Prompt("x", text="What is 2 + 2?").input_ids(tok)
    assert all(p["input_ids"].tolist() == want.tolist() for p in probs)
    assert "What is 2 + 2?" in tok.decode(want[0])
    ids = ev.prompt_input_ids(str(tmp_path / "c.jsonl"), tok)  # a benchmark's prompt option
    assert [x.tolist() for x in ids] == [want.tolist()] * 3


def test_cli_eval_and_fidelity_on_a_prompt_file(tiny, tmp_path, monkeypatch, capsys):
    from jacobi_ext import models
    from jacobi_ext.apps.cli import main

    model, tok = tiny
    prompts = write_jsonl(tmp_path / "mine.jsonl", ROWS)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (model, tok))
    res = tmp_path / "r.jsonl"
    argv = ["eval", "--prompts", str(prompts), "--results", str(res), "--methods", "greedy",
            "jacobi", "--max-new-tokens", "8", "--block-size", "4", "--limit", "3"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| jacobi | 3 |" in out and "pass@1 (tests)" in out  # random weights: 0 %
    assert len(ev.read_results(res)) == 6
    # fidelity reads the same file: the model scores its own greedy answers
    assert main(["fidelity", "--reference", str(res), "--prompts", str(prompts)]) == 0
    assert "3 tasks" in capsys.readouterr().out

    # errors before any model loads: the line and the field, exit 2
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(GOOD + "\n" + '{"prompt": "x", "anwser": "3"}\n')
    assert main(["eval", "--prompts", str(bad), "--results", str(res)]) == 2
    err = capsys.readouterr().err
    assert f"jacobi-forcing eval: error: {bad}:2: unknown field 'anwser'" in err
    (tmp_path / "empty.jsonl").write_text("")
    empty = str(tmp_path / "empty.jsonl")
    assert main(["fidelity", "--reference", str(res), "--prompts", empty]) == 2
    assert "no prompts" in capsys.readouterr().err
    assert main(["eval", "--prompts", "gsm8k", "--results", str(res)]) == 2
    assert "neither a prompt set" in capsys.readouterr().err
    argv = ["eval", "--prompts", str(prompts), "--results", str(res), "--checker", "answer"]
    assert main(argv) == 2
    assert "mine.jsonl:1: checker 'answer' (--checker) needs a field 'answer'" in (
        capsys.readouterr().err
    )
