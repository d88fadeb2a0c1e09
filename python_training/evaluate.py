"""HumanEval evaluation: TPF, tokens/s and speedup over transformers' greedy ``generate`` for
``jacobi`` and ``multiblock``, and pass@1 by executing each completion's tests.

Methods: ``greedy`` (transformers), ``prompt-lookup`` (transformers' prompt-lookup decoding,
10 draft tokens), ``ar``, ``jacobi`` and ``multiblock`` at the given block size (``multiblock``
with its default context-lookup candidate row; each row's ``settings`` names what ran), and
``multiblock-nolookup`` (the paper's multi-block decoding alone: no context-lookup row, so its
TPF is evidence of distillation, which lookup rows are not), and ``jacobi-tuned`` /
``multiblock-tuned`` with ``block_size=None`` (the engine's roofline tuner picks settings from
this machine's measured forward curve and the acceptance it observes).

``prompts``: ``"humaneval"`` (default; pass@1 by running each problem's tests),
``"code-heldout"``, the held-out package split of the shipped prompt corpus (whole packages the
distillation never saw; no tests, so pass@1 is not measured there), or the path of a JSONL file
of your own prompts (``read_prompt_file``: ``prompt`` or ``messages``, optional ``id``, and an
answer checker per row or per file, ``checkers.py``; docs/eval_your_prompts.md).
Every row keeps its token ids, so the summary can say whether each method's output equals
greedy's token for token (it must: the methods are lossless).

With ``sampling`` (do_sample, temperature, top_k, top_p, min_p, seed: jacobi_ext.decoding.sampling)
every row samples: ``greedy`` / ``prompt-lookup`` then run transformers' sampling with the same
filters (the speed baseline; another draw of the same law), our methods sample with the seed, and
``identical`` compares each method with our ``ar`` sample (the same noise), which must be equal.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from jacobi_ext.data import humaneval_input_ids, load_humaneval
from jacobi_ext.decoding import generate
from jacobi_ext.tools.baselines import hf_greedy, hf_sample

from .checkers import CHECKERS, MEASURES, check_row

METHODS = ("greedy", "prompt-lookup", "ar", "ar-lookup", "jacobi", "multiblock",
           "multiblock-nolookup", "jacobi-tuned", "multiblock-tuned")  # fmt: skip
PROMPT_SETS = ("humaneval", "code-heldout")


def done_rows(path: Path) -> set[tuple[str, str]]:
    """The (task id, method) rows a results JSONL already holds: what a resumed run skips."""
    if not path.exists():
        return set()
    out = set()
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a torn last line: that pair is redone
            continue
        out.add((r["task_id"], r["method"]))
    return out


def evaluate(
    model,
    tokenizer,
    results: str | Path,
    methods=("greedy", "jacobi", "multiblock"),
    limit: int | None = None,
    offset: int = 0,
    max_new_tokens: int = 256,
    block_size: int = 16,
    num_blocks: int = 2,
    pool_size: int = 4,
    timeout: float = 10.0,
    label: str = "",
    progress: bool = True,
    prompts: str = "humaneval",
    sampling: dict | None = None,
    checker: str | None = None,
) -> dict:
    """Decode every problem of ``prompts`` (from ``offset``, at most ``limit``) by every method,
    append one row per problem and method to ``results`` (resuming: pairs already there are
    skipped) and return ``summarize(results)``. ``checker`` (``tests`` / ``answer`` / ``none``)
    checks every row of a prompt file that way (default: each row by its own fields); ``none``
    also skips HumanEval's tests."""
    from tqdm.auto import tqdm

    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"unknown eval method(s) {bad}: choose from {list(METHODS)}")
    path = Path(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = done_rows(path)
    probs = _problems(prompts, tokenizer, checker)[offset:]
    probs = probs[:limit] if limit is not None else probs
    device = next(model.parameters()).device
    eos = model.generation_config.eos_token_id
    todo = [(p, m) for p in probs for m in methods if (p["task_id"], m) not in done]
    bar = tqdm(todo, desc=f"eval {label}".strip(), unit="run", disable=not progress)
    with open(path, "a") as f:
        for p, m in bar:
            ids = p["input_ids"].to(device)
            with torch.inference_mode():
                used = m
                if m in ("greedy", "prompt-lookup"):
                    kw = {"prompt_lookup_num_tokens": 10} if m == "prompt-lookup" else {}
                    if sampling:
                        f = {k: v for k, v in sampling.items() if k not in ("do_sample", "seed")}
                        toks, secs = hf_sample(model, ids, max_new_tokens,
                                               sampling.get("seed") or 0, **f, **kw)  # fmt: skip
                    else:
                        toks, secs = hf_greedy(model, ids, max_new_tokens, **kw)
                    toks = torch.tensor(toks, dtype=torch.long)
                    # greedy: one forward per token; prompt lookup does not report its count
                    forwards = int(toks.numel()) if m == "greedy" else None
                else:
                    tuned = m.endswith("-tuned")
                    # -nolookup / -lookup: context-lookup drafts off / on; else the default
                    lookup = {"-nolookup": False, "-lookup": True}.get(m[m.rfind("-") :])
                    base_m = m.removesuffix("-tuned").removesuffix("-nolookup")
                    base_m = base_m.removesuffix("-lookup")
                    r = generate(
                        model, ids, method=base_m, block_size=None if tuned else block_size,
                        num_blocks=num_blocks, pool_size=pool_size, lookup=lookup,
                        max_new_tokens=max_new_tokens, eos_token_id=eos, **(sampling or {}),
                    )  # fmt: skip
                    toks = r.tokens[0, : r.new_tokens]
                    secs, forwards = r.seconds + r.prefill_seconds, r.forwards
                    used = f"{r.method} n={r.block_size} K={r.num_blocks} p={r.pool_size}"
            text = tokenizer.decode(toks, skip_special_tokens=True)
            # HumanEval runs its tests; a prompt file's rows their checker; held-out corpus
            # prompts have none (passed None: no accuracy).
            name, ok, why = check_row(p, text, timeout)
            row = {
                "task_id": p["task_id"], "method": m, "label": label, "tokens": int(toks.numel()),
                "forwards": forwards, "seconds": round(secs, 4), "passed": ok, "result": why,
                "checker": name,
                "block_size": block_size if m not in ("greedy", "prompt-lookup") else 1,
                "completion": text, "token_ids": toks.tolist(), "settings": used,
                "sampling": sampling or None,
            }  # fmt: skip
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
    return summarize(path)


def _problems(prompts: str, tokenizer, checker: str | None = None) -> list[dict]:
    """The problems of a prompt set or file as dicts with ``task_id`` and ``input_ids``, and
    what checks them: HumanEval's fields (``test`` among them), or a prompt file row's
    ``checker`` and its fields (``read_prompt_file``)."""
    if checker is not None and checker not in CHECKERS:
        raise ValueError(f"unknown checker {checker!r}: choose from {list(CHECKERS)}")
    if prompts == "humaneval":
        if checker == "answer":
            raise ValueError("HumanEval is checked by its tests: --checker tests or none")
        return [{**p, "input_ids": humaneval_input_ids(tokenizer, p),
                 **({"checker": "none"} if checker == "none" else {})}
                for p in load_humaneval()]  # fmt: skip
    if prompts == "code-heldout":
        from .prompts import load_prompts

        if checker not in (None, "none"):
            raise ValueError("code-heldout has no tests or answers to check: --checker none")
        return [{"task_id": p.id, "input_ids": p.input_ids(tokenizer)}
                for p in load_prompts("code-heldout")]  # fmt: skip
    if not _is_prompt_file(prompts):
        raise ValueError(
            f"unknown prompt set {prompts!r}: choose from {list(PROMPT_SETS)} or give a JSONL "
            "file of prompts (.jsonl or .jsonl.gz)"
        )
    return [{**r, "input_ids": r["prompt"].input_ids(tokenizer)}
            for r in read_prompt_file(prompts, checker)]  # fmt: skip


def prompt_input_ids(prompts: str, tokenizer) -> list[torch.Tensor]:
    """The [1, P] input ids of every prompt of a set (``humaneval``, ``code-heldout``) or JSONL
    prompt file, formatted as ``evaluate`` decodes them: for a benchmark's prompt option."""
    return [p["input_ids"] for p in _problems(prompts, tokenizer, "none")]


def _is_prompt_file(prompts: str) -> bool:
    return str(prompts).endswith((".jsonl", ".jsonl.gz")) or Path(prompts).is_file()


# The fields a prompt file's line may hold. Exactly one of the prompt fields: ``prompt`` (or
# ``question``, GSM8K's name, or ``text``, collect's name) is one user message, ``messages`` a
# chat; ``meta`` is anything of the user's own, accepted and never read.
PROMPT_FIELDS = ("prompt", "question", "text", "messages")
CHECK_FIELDS = ("checker", "answer", "tests", "entry_point")
FIELDS = ("id", *PROMPT_FIELDS, *CHECK_FIELDS, "meta")


def read_prompt_file(path: str | Path, checker: str | None = None) -> list[dict]:
    """The rows of a JSONL prompt file (gzipped when its name ends in .gz), each a dict with
    ``task_id``, ``prompt`` (a ``prompts.Prompt``, formatted by its chat template exactly as
    collect formats its prompts) and ``checker`` (``tests`` / ``answer`` / ``none``) with the
    fields it needs (``tests`` and ``entry_point``, or ``answer``).

    One JSON object a line: exactly one of ``prompt`` / ``question`` / ``text`` (a user message)
    or ``messages`` (a chat: ``[{"role": ..., "content": ...}, ...]``, not ending in an assistant
    turn); optional ``id`` (default: a hash of the prompt, as collect's); optional ``tests``
    (Python; with an optional ``entry_point``), ``answer`` (a string or a number) and
    ``checker`` (which of them checks the row; needed only where a row has both); optional
    ``meta`` (ignored). Blank lines are skipped. ``checker`` given here checks every row that
    way (``none``: no row is checked). A bad line, an unknown field, a duplicate id or a file
    with no prompts is a ValueError naming the file, the line and the field."""
    import gzip

    from .prompts import Prompt, _content_id

    if checker is not None and checker not in CHECKERS:
        raise ValueError(f"unknown checker {checker!r}: choose from {list(CHECKERS)}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    opener = gzip.open if path.name.endswith(".gz") else open
    out, seen = [], {}
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON object ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: not a JSON object but a {type(row).__name__}")
            r = _prompt_row(row, where, checker)
            key, text, msgs = r.pop("key"), r.pop("text"), r.pop("messages")
            tid = str(row["id"]) if "id" in row else _content_id(row[key])
            if tid in seen:
                raise ValueError(f"{where}: field 'id': {tid!r} is already line {seen[tid]}'s")
            seen[tid] = lineno
            if msgs is not None:
                prompt = Prompt(tid, messages=tuple(dict(m) for m in msgs))
            else:
                prompt = Prompt(tid, text=text)
            out.append({"task_id": tid, "prompt": prompt, "line": lineno, **r})
    if not out:
        raise ValueError(f"{path}: no prompts (the file is empty or only blank lines)")
    return out


def _prompt_row(row: dict, where: str, checker: str | None) -> dict:
    """One line's fields checked: its prompt (``text`` or ``messages``), the key its default id
    hashes, and its checker with that checker's fields."""
    unknown = [k for k in row if k not in FIELDS]
    if unknown:
        raise ValueError(
            f"{where}: unknown field {unknown[0]!r} (a line holds {', '.join(FIELDS)}; "
            "put anything else under 'meta')"
        )
    keys = [k for k in PROMPT_FIELDS if k in row]
    if len(keys) != 1:
        raise ValueError(
            f"{where}: a line needs exactly one of the fields {', '.join(PROMPT_FIELDS)}"
            + (f", not {' and '.join(keys)}" if keys else "")
        )
    key = keys[0]
    out = {"key": key, "text": None, "messages": None}
    if key == "messages":
        out["messages"] = _messages(row[key], where)
    elif not isinstance(row[key], str) or not row[key].strip():
        raise ValueError(f"{where}: field {key!r} must be a non-empty string")
    else:
        out["text"] = row[key]
    if "id" in row and (isinstance(row["id"], bool) or not isinstance(row["id"], str | int)
                        or str(row["id"]) == ""):  # fmt: skip
        raise ValueError(f"{where}: field 'id' must be a non-empty string or an integer")
    if "answer" in row and (isinstance(row["answer"], bool)
                            or not isinstance(row["answer"], str | int | float)
                            or str(row["answer"]).strip() == ""):  # fmt: skip
        raise ValueError(f"{where}: field 'answer' must be a non-empty string or a number")
    for k in ("tests", "entry_point"):
        if k in row and (not isinstance(row[k], str) or not row[k].strip()):
            raise ValueError(f"{where}: field {k!r} must be a non-empty string")
    if "entry_point" in row and not str(row["entry_point"]).isidentifier():
        raise ValueError(f"{where}: field 'entry_point' must be a Python name")
    if "entry_point" in row and "tests" not in row:
        raise ValueError(f"{where}: field 'entry_point' needs a 'tests' field")
    if "checker" in row and row["checker"] not in CHECKERS:
        choices = ", ".join(CHECKERS)
        raise ValueError(
            f"{where}: field 'checker' must be one of {choices}, not {row['checker']!r}"
        )
    name = checker or row.get("checker")
    if name is None:  # chosen by the row's fields
        has = [k for k in ("tests", "answer") if k in row]
        if len(has) == 2:
            raise ValueError(
                f"{where}: the fields 'tests' and 'answer' are both there: say which checks "
                "the line with a 'checker' field (or --checker for the whole file)"
            )
        name = has[0] if has else "none"
    field = {"tests": "tests", "answer": "answer"}.get(name)
    if field and field not in row:
        by = "--checker" if checker else "the line's 'checker' field"
        raise ValueError(f"{where}: checker {name!r} ({by}) needs a field {field!r}")
    out["checker"] = name
    if name == "tests":
        out["tests"] = row["tests"]
        if "entry_point" in row:
            out["entry_point"] = row["entry_point"]
    elif name == "answer":
        out["answer"] = row["answer"]
    return out


def _messages(msgs, where: str) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: field 'messages' must be a non-empty list of turns")
    for i, m in enumerate(msgs):
        if (
            not isinstance(m, dict)
            or set(m) - {"role", "content"}
            or not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str))
        ):
            raise ValueError(
                f"{where}: field 'messages', turn {i}: must be "
                '{"role": "<string>", "content": "<string>"}'
            )
    if msgs[-1]["role"] == "assistant":
        raise ValueError(
            f"{where}: field 'messages' ends in an assistant turn: end it with the user's, "
            "for the model to answer"
        )
    return msgs


def summarize(results: str | Path) -> dict:
    """Per method: tasks, TPF (tokens / forwards), tokens/s (tokens / seconds), speedup over
    greedy's tokens/s on the same tasks (transformers' sampling for sampled rows), pass@1, and
    ``identical``: the fraction of tasks (run by both) whose token ids equal the reference's:
    greedy's, or for sampled rows our ``ar`` sample's (None where rows carry no ids)."""
    return summarize_rows(read_results(results))


def read_results(results: str | Path) -> list[dict]:
    """The rows of an ``evaluate`` results file (JSONL, one row per task and method; gzipped
    when its name ends in .gz, as results committed to the repo are)."""
    path = Path(results)
    if path.suffix == ".gz":
        import gzip

        text = gzip.decompress(path.read_bytes()).decode()
    else:
        text = path.read_text()
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def summarize_rows(rows: list[dict]) -> dict:
    """``summarize`` of result rows already read (several files' together, or a subset)."""
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        by.setdefault(r["method"], {})[r["task_id"]] = r
    out = {}
    greedy = by.get("greedy", {})
    sampled = any(r.get("sampling") for r in rows)
    ref_m = "ar" if sampled else "greedy"
    ref = by.get(ref_m, {})
    for m, rs in by.items():
        tok = sum(r["tokens"] for r in rs.values())
        fw = sum(r["forwards"] or 0 for r in rs.values())
        sec = sum(r["seconds"] for r in rs.values())
        common = [t for t in rs if t in greedy]
        sp = None
        if common and m != "greedy":
            a = sum(rs[t]["tokens"] for t in common) / sum(rs[t]["seconds"] for t in common)
            g = sum(greedy[t]["tokens"] for t in common) / sum(greedy[t]["seconds"] for t in common)
            sp = a / g
        both = [t for t in rs if t in ref]
        same = [t for t in both if "token_ids" in rs[t] and "token_ids" in ref[t]]
        ident = None
        if same:
            ident = sum(rs[t]["token_ids"] == ref[t]["token_ids"] for t in same) / len(same)
        if sampled and m in ("greedy", "prompt-lookup"):
            ident = None  # transformers' own generator: another sample, not ours
        out[m] = {
            "tasks": len(rs),
            "tpf": tok / fw if fw else None,
            "tokens_per_s": tok / sec if sec else float("nan"),
            "speedup": 1.0 if m == "greedy" else sp,
            "pass@1": _pass_at_1(rs.values()),
            "accuracy": _accuracy(rs.values()),
            "identical": 1.0 if m == ref_m else ident,
        }
    return out


def _pass_at_1(rows) -> float | None:
    """The fraction of checked rows that passed, whatever checked them (tests or answers)."""
    tested = [r["passed"] for r in rows if r["passed"] is not None]
    return sum(tested) / len(tested) if tested else None


def _accuracy(rows) -> dict[str, dict]:
    """Per checker (rows written before checkers were named are HumanEval's: ``tests``): the
    rows it checked, how many passed, and the fraction."""
    acc: dict[str, list] = {}
    for r in rows:
        if r["passed"] is not None:
            acc.setdefault(r.get("checker") or "tests", []).append(bool(r["passed"]))
    return {k: {"checked": len(v), "passed": sum(v), "rate": sum(v) / len(v)}
            for k, v in sorted(acc.items())}  # fmt: skip


def format_summary(s: dict) -> str:
    """The summary as a markdown table. The accuracy column's heading names the checkers that
    gave it (``tests``: pass@1, ``answer``: exact match; "none" where no row was checked); where
    a method's rows were checked by both, its cell gives each checker's share."""
    names = sorted({k for r in s.values() for k in r.get("accuracy") or {}})
    if not names and any(r.get("pass@1") is not None for r in s.values()):
        names = ["tests"]  # a summary from before checkers were named
    head = ", ".join(f"{MEASURES[k]} ({k})" for k in names) if names else "none"
    lines = [
        f"| method | tasks | TPF | tokens/s | speedup vs HF greedy | accuracy: {head} "
        "| identical to greedy |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in s.items():
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        acc = r.get("accuracy") or {}
        if len(acc) > 1:
            cell = ", ".join(f"{k} {_pct(a['rate'])} of {a['checked']}" for k, a in acc.items())
        else:
            cell = _pct(r["pass@1"])
        lines.append(
            f"| {m} | {r['tasks']} | {_num(r['tpf'])} | {r['tokens_per_s']:.1f} | {sp} "
            f"| {cell} | {_ident(r.get('identical'))} |"
        )
    return "\n".join(lines)


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ident(x) -> str:
    if x is None:
        return "-"
    return "yes" if x == 1.0 else f"no ({100 * x:.0f}% of tasks)"
