"""The offline training-prompt corpus: HumanEval-style prompts from installed Python code.

Jacobi Forcing learns from the teacher's answers to many prompts; HumanEval (the evaluation) is
held out, and nothing may be downloaded. So the prompts are built from what is on disk: every
public module-level function with a docstring in the standard library and in the installed
packages becomes a signature plus docstring to complete, exactly the shape of a HumanEval prompt,
and is wrapped in the same instruction and chat template as evaluation (``Prompt(code=...)``).

Built from source text with ``ast`` (nothing is imported, so no package's import side effects and
no dependence on what imports cleanly), in a fixed order (packages, files, functions in
source order), shuffled with a fixed seed, so one environment always gives the same corpus.

Rules:
- module-level functions and the methods of classes (``class Name:`` above an indented ``def``);
- public only: no path component, class or function name starting with ``_``; no test code
  (``test`` / ``tests`` / ``testing`` folders, ``test_*.py`` / ``*_test.py``, ``conftest.py``);
- the docstring's first ``MAX_DOC_LINES`` lines, between ``MIN_DOC_CHARS`` and
  ``MAX_DOC_CHARS`` characters, a signature of at most ``MAX_SIG_CHARS``;
- deduplicated: a function whose (normalised) docstring was already taken is dropped (copies,
  aliases, vendored code, overrides that repeat their base's doc), and so is a second
  (name, signature) pair;
- never HumanEval: HumanEval entry points and docstrings are excluded
  (``prompts.check_no_humaneval_overlap`` runs on the result);
- a **held-out split by package**: whole packages (``HELDOUT_PACKAGES``) that training never sees,
  so generalisation is measured on code the model has not met.

The built corpus ships in the repo (``python_training/data/code_prompts.jsonl.gz`` and its
manifest); ``jacobi-forcing prompts build`` rebuilds it, ``load_prompts("code")`` /
``load_prompts("code-heldout")`` read it (``prompts.load_corpus``: reading needs nothing of this
module).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from .prompts import (
    CORPUS,
    CORPUS_DIR,
    Prompt,
    _norm,
    humaneval_index,
    humaneval_overlap,
)

MANIFEST = CORPUS_DIR / "code_prompts.manifest.json"
MIN_DOC_CHARS = 40
MAX_DOC_CHARS = 1200
MAX_DOC_LINES = 14
MAX_SIG_CHARS = 160
# Whole packages kept out of training. Chosen for code that reads like HumanEval (algorithms,
# data handling) and is unlike the rest: graph algorithms and a terminal-formatting library.
HELDOUT_PACKAGES = ("networkx", "rich")
# Top-level names in site-packages that are not libraries of their own (build/packaging
# machinery, this project, and pip's vendored copies, which repeat other packages).
SKIP_PACKAGES = {"pip", "setuptools", "pkg_resources", "_distutils_hack", "jacobi_ext",
                 "python_training", "wheel", "distutils-precedence"}  # fmt: skip
_TEST_DIRS = {"test", "tests", "testing", "idlelib", "lib2to3", "turtledemo", "ensurepip"}


def _is_test_or_private(rel: Path) -> bool:
    parts = rel.parts
    if any(p.startswith("_") and p != "__init__.py" for p in parts):
        return True
    if any(p in _TEST_DIRS for p in parts[:-1]):
        return True
    name = parts[-1]
    return name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"


def source_roots() -> list[tuple[str, Path]]:
    """(package, path) for the stdlib's top-level modules and each site-packages package,
    sorted by package name (stdlib modules are each their own package: ``stdlib.<name>``)."""
    roots: list[tuple[str, Path]] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(stdlib.iterdir()):
        if p.name in ("site-packages", "dist-packages") or p.name.startswith("_"):
            continue
        if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py":
            roots.append((f"stdlib.{p.stem}", p))
    site = Path(sysconfig.get_paths()["purelib"])
    for p in sorted(site.iterdir()):
        name = p.stem if p.suffix == ".py" else p.name
        if name in SKIP_PACKAGES or name.startswith("_") or "." in name or "-" in name:
            continue
        if (p.is_dir() and any(p.glob("*.py"))) or p.suffix == ".py":
            roots.append((name, p))
    return sorted(roots)


def _python_files(root: Path) -> Iterator[tuple[str, Path]]:
    if root.is_file():
        yield root.stem, root
        return
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root.parent)
        if _is_test_or_private(rel):
            continue
        mod = ".".join(rel.with_suffix("").parts)
        yield (mod[: -len(".__init__")] if mod.endswith(".__init__") else mod), f


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> str | None:
    args = node.args
    first = (args.posonlyargs + args.args)[:1]
    # A method's first parameter is its self/cls; a module-level function has none.
    if method != bool(first and first[0].arg in ("self", "cls")):
        return None
    try:
        sig = f"({ast.unparse(args)})"
        if node.returns is not None:
            sig += f" -> {ast.unparse(node.returns)}"
    except Exception:  # noqa: BLE001 (exotic syntax ast cannot unparse on this Python)
        return None
    return sig if len(sig) <= MAX_SIG_CHARS else None


def function_prompt(
    name: str, sig: str, doc: str, is_async: bool = False, cls: str | None = None
) -> str:
    """The code a prompt asks to complete: ``def name(sig):`` and the docstring, HumanEval-style;
    a method inside a ``class <cls>:`` line."""
    ind = "    " if cls else ""
    lines = doc.strip().splitlines()[:MAX_DOC_LINES]
    lines = [ln.replace('"""', "'''").replace("\\", "\\\\") for ln in lines]
    body = "\n".join((ind + "    " + ln).rstrip() for ln in lines)
    kw = "async def" if is_async else "def"
    head = f"class {cls}:\n" if cls else ""
    return f'{head}{ind}{kw} {name}{sig}:\n{ind}    """{body.lstrip()}\n{ind}    """\n'


def _doc(node) -> str | None:
    doc = ast.get_docstring(node)
    if not doc:
        return None
    doc = "\n".join(doc.strip().splitlines()[:MAX_DOC_LINES])
    return doc if MIN_DOC_CHARS <= len(doc) <= MAX_DOC_CHARS else None


def iter_candidates(path: Path) -> Iterator[tuple[str, str]]:
    """(qualified name, prompt code) of a file's public module-level functions
    and the public methods of its public classes, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, funcs):
            members, cls = [node], None
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            members, cls = [m for m in node.body if isinstance(m, funcs)], node.name
        else:
            continue
        for fn in members:
            if fn.name.startswith("_"):
                continue
            doc = _doc(fn)
            sig = _signature(fn, method=cls is not None) if doc else None
            if sig is None:
                continue
            code = function_prompt(fn.name, sig, doc, isinstance(fn, ast.AsyncFunctionDef), cls)
            yield (f"{cls}.{fn.name}" if cls else fn.name), code


def build_corpus(progress: bool = True) -> tuple[list[dict], dict]:
    """All prompts of this environment (rows with id, package, module, split, prompt) and the
    manifest (counts per package and split, why candidates were dropped)."""
    from tqdm.auto import tqdm

    he_index = humaneval_index()
    rows: list[dict] = []
    seen_docs: set[str] = set()
    seen_sigs: set[tuple[str, str]] = set()
    dropped: Counter = Counter()
    roots = source_roots()
    for package, root in tqdm(roots, desc="scan", unit="pkg", disable=not progress):
        top = package.split(".")[0] if package.startswith("stdlib.") else package
        split = "heldout" if top in HELDOUT_PACKAGES else "train"
        for module, path in _python_files(root):
            for qualname, code in iter_candidates(path):
                doc_key = _norm(code.split('"""', 1)[1])
                sig_key = _norm(code.split('"""', 1)[0].split("def ", 1)[1])  # name + signature
                if humaneval_overlap(code, he_index):
                    dropped["humaneval"] += 1
                elif doc_key in seen_docs:
                    dropped["duplicate_docstring"] += 1
                elif sig_key in seen_sigs:
                    dropped["duplicate_signature"] += 1
                else:
                    seen_docs.add(doc_key)
                    seen_sigs.add(sig_key)
                    pid = f"{module}.{qualname}"
                    rows.append({"id": pid, "package": package, "module": module,
                                 "split": split, "prompt": code})  # fmt: skip
    # Shuffled with a fixed seed: any prefix of a split is a sample of every package, so a run
    # that collects the first N prompts does not see only the packages sorted first.
    random.Random(0).shuffle(rows)
    ids = Counter(r["id"] for r in rows)  # the same qualified name in two places (rare)
    for r in rows:
        if ids[r["id"]] > 1:
            r["id"] += "#" + hashlib.sha1(r["prompt"].encode()).hexdigest()[:8]
    per_pkg = Counter((r["package"] if not r["package"].startswith("stdlib.") else "stdlib")
                      for r in rows)  # fmt: skip
    manifest = {
        "python": sys.version.split()[0],
        "total": len(rows),
        "splits": dict(Counter(r["split"] for r in rows)),
        "heldout_packages": list(HELDOUT_PACKAGES),
        "dropped": dict(dropped),
        "per_package": dict(sorted(per_pkg.items(), key=lambda kv: (-kv[1], kv[0]))),
        "rules": {
            "min_doc_chars": MIN_DOC_CHARS,
            "max_doc_chars": MAX_DOC_CHARS,
            "max_doc_lines": MAX_DOC_LINES,
            "max_sig_chars": MAX_SIG_CHARS,
        },  # fmt: skip
    }
    return rows, manifest


def token_length_stats(rows: list[dict], tokenizer) -> dict:
    """Chat-formatted prompt lengths in tokens (min / median / p90 / max, per split)."""
    out = {}
    for split in sorted({r["split"] for r in rows}):
        lens = sorted(
            Prompt(r["id"], code=r["prompt"]).input_ids(tokenizer).shape[1]
            for r in rows
            if r["split"] == split
        )
        n = len(lens)
        out[split] = {"min": lens[0], "median": lens[n // 2], "p90": lens[int(n * 0.9)],
                      "max": lens[-1], "tokens": sum(lens)}  # fmt: skip
    return out


def write_corpus(rows: list[dict], manifest: dict, path: Path = CORPUS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # No name, mtime=0: the same rows give the same bytes (a rebuild here is a no-op).
    with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
        for r in rows:
            f.write((json.dumps(r, sort_keys=True) + "\n").encode())
    manifest = dict(manifest, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    path.with_name(path.name.replace(".jsonl.gz", ".manifest.json")).write_text(
        json.dumps(manifest, indent=1) + "\n"
    )
