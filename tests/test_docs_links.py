"""Every relative link in README.md and docs/*.md (not docs/results/**) points at a file or folder
that exists in the repository. Anchors (#...) are ignored; web links, mail links and links inside
code blocks, inline code or HTML comments are not checked. The README stays a front door."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) and ![alt](target), with an optional "title"; <target> form too.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target (reference definitions)
_REF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)


def without_code_blocks(text: str) -> str:
    """The text without its fenced code blocks. A block closes at a fence of its own character at
    least as long as its opening one, so a ````markdown block may hold ``` blocks."""
    out, fence = [], None
    for line in text.splitlines(keepends=True):
        m = _FENCE.match(line)
        if fence is None:
            if m and not (m.group(1)[0] == "`" and "`" in line[m.end() :]):
                fence = m.group(1)
            else:
                out.append(line)
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
            if not line[m.end() :].strip():
                fence = None
    return "".join(out)


def relative_links(text: str) -> list[str]:
    """The relative link targets of a Markdown text, without anchors."""
    text = _COMMENT.sub("", without_code_blocks(text))
    text = _CODE.sub("", text)
    out = []
    for target in [*_LINK.findall(text), *_REF.findall(text)]:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, https:, mailto:, ... or an anchor on the same page
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if path:
            out.append(path)
    return out


def test_the_parser_finds_links_and_skips_code():
    text = (
        'See [a](docs/a.md#x) and ![b](img.png "t"), [w](https://x.org), [s](#top).\n'
        "`[no](code.md)` <!-- [no](comment.md) -->\n"
        "```\n[no](fenced.md)\n```\n"
        "````markdown\n```bash\nx\n```\n[no](nested.md)\n````\n"
        "[ref]: other.md\n"
    )
    assert relative_links(text) == ["docs/a.md", "img.png", "other.md"]


def resolve(page: Path, target: str) -> Path:
    """A link's path: from the repository root if it starts with /, else from the page."""
    return ROOT / target.lstrip("/") if target.startswith("/") else page.parent / target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    text = page.read_text(encoding="utf-8")
    missing = [t for t in relative_links(text) if not resolve(page, t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to paths that do not exist: {missing}"


METHOD = ROOT / "docs" / "method.md"
# Files whose comments, docstrings and text may cite the method's sections.
CITING = ("*.py", "*.h", "*.cuh", "*.cpp", "*.cu", "*.md", "*.toml")
# "docs/method.md §2", "method.md §1-§3", "[method](../docs/method.md) §1–§3", "§2, §3"
_CITE = re.compile(r"method\.md\)?((?:[\s,–-]*§\d+)+)")
_SECTION = re.compile(r"^## (\d+)\. ", re.M)
# An all-capitals name, a space, a section sign and a number: a document not in the repository.
_FOREIGN = re.compile(r"\b[A-Z][A-Z0-9_]+ §\d+")


def citing_files() -> list[Path]:
    """The repository's source and text files, without build outputs and dated results."""
    skip = ("build", "docs/results", ".git", ".venv", "node_modules")
    out = []
    for pattern in CITING:
        for f in ROOT.rglob(pattern):
            rel = f.relative_to(ROOT).as_posix()
            if not any(rel == s or rel.startswith(s + "/") for s in skip) and f.is_file():
                out.append(f)
    return sorted(set(out))


def test_the_method_guide_is_checked():
    assert METHOD in PAGES, "docs/method.md must be among the pages whose links are checked"
    sections = [int(s) for s in _SECTION.findall(METHOD.read_text(encoding="utf-8"))]
    assert sections == list(range(1, len(sections) + 1)) and sections, sections


def test_method_citations_name_existing_sections():
    """Every "docs/method.md §N" in the code and guides names a numbered section of the guide,
    and no section sign cites a document outside the repository."""
    sections = set(_SECTION.findall(METHOD.read_text(encoding="utf-8")))
    bad, foreign = [], []
    for f in citing_files():
        text = f.read_text(encoding="utf-8", errors="replace")
        rel = f.relative_to(ROOT).as_posix()
        for m in _CITE.finditer(text):
            for num in re.findall(r"§(\d+)", m.group(1)):
                if num not in sections:
                    bad.append(f"{rel}: §{num}")
        foreign += [f"{rel}: {m.group(0)}" for m in _FOREIGN.finditer(text)]
    assert not bad, f"citations of sections docs/method.md does not have: {bad}"
    assert not foreign, f"citations of a document outside the repository: {foreign}"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines; keep it to 250 and move detail to docs/"
