"""Training prompts: a JSONL source, and an embedded default that needs no download.

The default is built from the Python standard library's public functions, in HumanEval's own
format (a signature and docstring to complete) and wrapped with the same instruction and chat
template the evaluation uses (``jacobi_ext.data.INSTRUCTION``), so the trajectories the teacher
writes look like the answers it is measured on. HumanEval itself is held out: every source is
checked against its prompts and entry points (:func:`check_no_humaneval_overlap`).

JSONL lines hold one of
  ``{"id": ..., "prompt": "<code to complete>"}``  (wrapped in INSTRUCTION, like HumanEval),
  ``{"id": ..., "text": "<a user message>"}``,
 ``{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}``  (a chat ending in a user turn);
``id`` is optional (a hash of the content is used). A ``.gz`` file is read as gzip.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import inspect
import json
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from jacobi_ext.data import INSTRUCTION, load_humaneval

#: The shipped corpus of installed-code prompts: built by ``prompt_corpus`` (``jacobi-forcing
#: prompts build``), read here (``load_corpus``).
CORPUS_DIR = Path(__file__).parent / "data"
CORPUS = CORPUS_DIR / "code_prompts.jsonl.gz"

# Pure-Python stdlib modules whose public functions have readable signatures and docstrings.
STDLIB_MODULES = (
    "base64", "bisect", "calendar", "colorsys", "copy", "csv", "dataclasses", "datetime",
    "difflib", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "ftplib", "functools",
    "genericpath", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html",
    "http.cookies", "imghdr", "inspect", "ipaddress", "json", "keyword", "linecache", "locale",
    "logging", "mimetypes", "ntpath", "numbers", "operator", "optparse", "os", "pathlib",
    "pickle", "pkgutil", "platform", "plistlib", "posixpath", "pprint", "quopri", "random",
    "re", "reprlib", "secrets", "shlex", "shutil", "smtplib", "statistics", "string",
    "struct", "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap", "tokenize",
    "traceback", "types", "typing", "unittest.util", "urllib.parse", "urllib.request", "uu",
    "uuid", "warnings", "weakref", "xml.dom.minidom", "xml.sax.saxutils", "zipfile", "zoneinfo",
    "argparse", "ast", "asyncio.tasks", "codecs", "collections", "compileall", "concurrent.futures",
    "configparser", "contextlib", "ctypes.util", "dis", "doctest", "email.header",
    "email.message", "email.quoprimime", "email.base64mime", "graphlib", "http.client",
    "http.server", "importlib.util", "io", "mailbox", "netrc", "opcode", "pdb", "pydoc",
    "runpy", "sched", "selectors", "site", "socket", "ssl", "stat", "symtable", "tabnanny",
    "threading", "timeit", "trace", "wave", "webbrowser", "wsgiref.util", "wsgiref.headers",
    "xml.etree.ElementTree", "zipapp", "tomllib", "unittest.case", "unittest.mock",
    "multiprocessing.connection", "email.feedparser", "email.policy", "lib2to3.pytree",
)  # fmt: skip
MAX_DOC_LINES = 14


@dataclass(frozen=True)
class Prompt:
    """One training prompt: exactly one of ``code`` (HumanEval-style, wrapped in INSTRUCTION),
    ``text`` (a user message) or ``messages`` (a chat) is set."""

    id: str
    code: str | None = None
    text: str | None = None
    messages: tuple | None = None

    def chat(self) -> list[dict]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        content = INSTRUCTION.format(prompt=self.code) if self.code is not None else self.text
        return [{"role": "user", "content": content}]

    def input_ids(self, tokenizer) -> torch.Tensor:
        """[1, P] ids, formatted exactly as ``jacobi_ext.data.humaneval_input_ids`` does."""
        msgs = self.chat()
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, return_tensors="pt"
            )
            if not isinstance(ids, torch.Tensor):
                ids = ids["input_ids"]
            return ids.to(torch.long)
        return tokenizer("\n".join(m["content"] for m in msgs), return_tensors="pt").input_ids


def _content_id(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def load_jsonl(path: str | Path) -> list[Prompt]:
    out, seen = [], set()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            keys = [k for k in ("prompt", "text", "messages") if k in row]
            if len(keys) != 1:
                raise ValueError(
                    f"{path}:{lineno}: a line needs exactly one of prompt / text / messages"
                )
            k = keys[0]
            pid = str(row.get("id") or _content_id(row[k]))
            if pid in seen:
                raise ValueError(f"{path}:{lineno}: duplicate prompt id {pid!r}")
            seen.add(pid)
            if k == "prompt":
                out.append(Prompt(pid, code=row[k]))
            elif k == "text":
                out.append(Prompt(pid, text=row[k]))
            else:
                out.append(Prompt(pid, messages=tuple(dict(m) for m in row[k])))
    return out


def _stdlib_prompt(name: str, fn) -> str | None:
    doc = inspect.getdoc(fn)
    if not doc or len(doc) < 40:
        return None
    try:
        sig = str(inspect.signature(fn))
    except (TypeError, ValueError):
        return None
    # Reprs like <object object at 0x...> or module-internal sentinels make poor prompts.
    if "<" in sig.replace("->", "") or len(sig) > 160 or sig.startswith("(self"):
        return None
    lines = doc.strip().splitlines()[:MAX_DOC_LINES]
    lines = [ln.replace('"""', "'''").replace("\\", "\\\\") for ln in lines]
    body = "\n".join(("    " + ln).rstrip() for ln in lines)
    return f'def {name}{sig}:\n    """{body.lstrip()}\n    """\n'


def stdlib_prompts(modules: Iterable[str] = STDLIB_MODULES) -> list[Prompt]:
    """HumanEval-style prompts from the stdlib's public Python functions (deterministic order).

    Functions whose name is a HumanEval entry point are left out (held-out set)."""
    held_out = {p["entry_point"] for p in load_humaneval()}
    out, seen_names = [], set()
    for modname in modules:
        try:
            with warnings.catch_warnings():  # deprecated modules still give good prompts
                warnings.simplefilter("ignore", DeprecationWarning)
                mod = importlib.import_module(modname)
        except Exception:  # noqa: BLE001 (modules removed in newer Pythons, e.g. imghdr, uu)
            continue
        for name in sorted(vars(mod)):
            fn = getattr(mod, name)
            if name.startswith("_") or not inspect.isfunction(fn):
                continue
            if getattr(fn, "__module__", None) != mod.__name__ or name in held_out:
                continue  # re-exports would repeat prompts; held-out names never train
            code = _stdlib_prompt(name, fn)
            if code is None or (name, code) in seen_names:
                continue
            seen_names.add((name, code))
            out.append(Prompt(f"stdlib:{modname}.{name}", code=code))
    return out


def load_prompts(source: str | None = None, limit: int | None = None) -> list[Prompt]:
    """A prompt source, HumanEval-checked:
    ``"code"`` / ``"code-heldout"``: the shipped corpus of installed-code prompts, its training or
    its held-out-packages split (``prompt_corpus``, ~17 k / ~1.4 k prompts);
    ``None`` / ``"stdlib"``: the 661 stdlib prompts built at import time;
    anything else: a JSONL file."""
    if source in ("code", "code-heldout"):
        prompts = load_corpus("heldout" if source == "code-heldout" else "train")
    elif source in (None, "stdlib"):
        prompts = stdlib_prompts()
        check_no_humaneval_overlap(prompts)
    else:
        if not Path(source).is_file():
            raise FileNotFoundError(
                f"prompt source {source!r} is neither 'code', 'code-heldout', 'stdlib' nor a "
                "JSONL file"
            )
        prompts = load_jsonl(source)
        check_no_humaneval_overlap(prompts)
    return prompts[:limit] if limit is not None else prompts


def load_corpus(split: str | None = "train", path: Path = CORPUS) -> list[Prompt]:
    """The shipped corpus as Prompts (``split``: "train", "heldout" or None for both)."""
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: rebuild it with `jacobi-forcing prompts build`"
        )
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = [Prompt(r["id"], code=r["prompt"]) for r in rows if split in (None, r["split"])]
    check_no_humaneval_overlap(prompts)
    return prompts


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip().lower()


def _defined_names(text: str) -> set[str]:
    return set(re.findall(r"def\s+([A-Za-z_]\w*)\s*\(", text))


def humaneval_index() -> tuple[dict[str, str], dict[str, str]]:
    """HumanEval's entry points and normalised docstring heads, each mapped to its task id."""
    problems = load_humaneval()
    entry = {p["entry_point"]: p["task_id"] for p in problems}
    docs = {}
    for p in problems:
        m = re.search(r'("""|\'\'\')(.*?)\1', p["prompt"], re.S)
        if m and len(_norm(m.group(2))) > 30:
            docs[_norm(m.group(2))[:120]] = p["task_id"]
    return entry, docs


def humaneval_overlap(text: str, index: tuple[dict, dict] | None = None) -> str | None:
    """Why ``text`` overlaps HumanEval (it defines an entry point or contains a docstring), or
    None."""
    entry, docs = index or humaneval_index()
    for name in _defined_names(text):
        if name in entry:
            return f"defines {name}, the entry point of {entry[name]} (HumanEval is held out)"
    norm = _norm(text)
    for d, tid in docs.items():
        if d in norm:
            return f"contains the docstring of {tid}"
    return None


def check_no_humaneval_overlap(prompts: Iterable[Prompt]) -> None:
    """Raise if a training prompt defines a HumanEval entry point or contains a HumanEval
    prompt's docstring (whitespace- and case-insensitive)."""
    index = humaneval_index()
    for pr in prompts:
        why = humaneval_overlap("\n".join(m["content"] for m in pr.chat()), index)
        if why:
            raise ValueError(f"training prompt {pr.id} {why}")
