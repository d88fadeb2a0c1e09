"""The shipped training-prompt corpus (python_training/prompt_corpus.py): its size, its held-out
split by package, no HumanEval, no duplicates, a manifest that matches the file; and the
builder's rules on a small source tree."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter

import pytest

from python_training import prompt_corpus as pc
from python_training.prompts import load_prompts


def compiles(code: str, name: str) -> None:
    """The prompt is valid Python once a body is added (a method's body is indented deeper)."""
    body = "        pass\n" if code.startswith("class ") else "    pass\n"
    compile(code + body, name, "exec")


@pytest.fixture(scope="module")
def rows():
    with gzip.open(pc.CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_shipped_corpus_size_and_split(rows):
    splits = Counter(r["split"] for r in rows)
    assert splits["train"] >= 10_000
    assert splits["heldout"] >= 300
    held = {r["package"] for r in rows if r["split"] == "heldout"}
    train = {r["package"] for r in rows if r["split"] == "train"}
    assert held == set(pc.HELDOUT_PACKAGES)
    assert not held & train, "a held-out package must never reach training"
    assert pc.CORPUS.stat().st_size <= 10e6


def test_shipped_corpus_is_distinct_and_matches_manifest(rows):
    assert len({r["id"] for r in rows}) == len(rows)
    docs = [r["prompt"].split('"""', 1)[1] for r in rows]
    assert len(set(docs)) == len(rows)
    m = json.loads(pc.MANIFEST.read_text())
    assert m["total"] == len(rows)
    assert m["splits"] == dict(Counter(r["split"] for r in rows))
    assert m["sha256"] == hashlib.sha256(pc.CORPUS.read_bytes()).hexdigest()
    assert sum(m["per_package"].values()) == len(rows)
    for r in rows[:200]:
        compiles(r["prompt"], r["id"])


def test_load_prompts_code_splits_are_humaneval_checked():
    train, held = load_prompts("code"), load_prompts("code-heldout")
    assert len(train) >= 10_000 and len(held) >= 300
    assert not {p.id for p in train} & {p.id for p in held}
    assert "Complete the following Python function" in train[0].chat()[0]["content"]
    with pytest.raises(FileNotFoundError, match="neither"):
        load_prompts("no-such-source.jsonl")


def test_builder_rules(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "demo_pkg"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "_private").mkdir()
    doc = "Return the sum of the squares of the numbers in a list of integers."
    (pkg / "__init__.py").write_text(
        f'def sum_squares_list(xs):\n    """{doc}"""\n    return 0\n\n'
        f'def alias(xs):\n    """{doc}"""\n\n'  # the same docstring again: dropped
        'def short(x):\n    """Too short."""\n\n'
        'def _hidden(x):\n    """A private function with a long enough docstring here."""\n\n'
        "class Stack:\n"
        '    def push(self, item):\n        """Push an item on top of the stack, growing it."""\n'
        '    def _grow(self):\n        """A private method with a long enough docstring."""\n'
    )
    (pkg / "tests" / "test_x.py").write_text(
        'def helper_in_tests(a):\n    """A helper in a test folder, which never trains."""\n'
    )
    (pkg / "_private" / "m.py").write_text(
        'def in_private(a):\n    """A function in a private module, which is left out."""\n'
    )
    (pkg / "he.py").write_text(
        'def has_close_elements(numbers, threshold):\n    """A HumanEval entry point."""\n'
    )
    found = {}
    for module, path in pc._python_files(pkg):
        for qual, code in pc.iter_candidates(path):
            found[f"{module}.{qual}"] = code
    assert set(found) == {
        "demo_pkg.sum_squares_list", "demo_pkg.alias", "demo_pkg.Stack.push",
    }  # fmt: skip
    assert found["demo_pkg.Stack.push"].startswith("class Stack:\n    def push(self, item):")
    compiles(found["demo_pkg.Stack.push"], "push")
    compiles(found["demo_pkg.sum_squares_list"], "sum_squares_list")

    monkeypatch.setattr(pc, "source_roots", lambda: [("demo_pkg", pkg)])
    rows, manifest = pc.build_corpus(progress=False)
    assert sorted(r["id"] for r in rows) == ["demo_pkg.Stack.push", "demo_pkg.sum_squares_list"]
    assert manifest["dropped"]["duplicate_docstring"] == 1
    assert all(r["split"] == "train" for r in rows)
    # Deterministic, down to the bytes of the written file.
    a, b = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    pc.write_corpus(rows, manifest, a)
    pc.write_corpus(pc.build_corpus(progress=False)[0], manifest, b)
    assert a.read_bytes() == b.read_bytes()
