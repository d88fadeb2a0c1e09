"""HumanEval evaluation: TPF, tokens/s and speedup over transformers' greedy ``generate`` for
``jacobi`` and ``multiblock``, and pass@1 by executing each completion's tests.

Methods: ``greedy`` (transformers), ``prompt-lookup`` (transformers' prompt-lookup decoding,
10 draft tokens), ``ar``, ``jacobi`` and ``multiblock`` at the given block size (``multiblock``
with its default context-lookup candidate row; each row's ``settings`` names what ran), and
``multiblock-nolookup`` (the paper's multi-block decoding alone: no context-lookup row, so its
TPF is evidence of distillation, which lookup rows are not), and ``jacobi-tuned`` /
``multiblock-tuned`` with ``block_size=None`` (the engine's roofline tuner picks settings from
this machine's measured forward curve and the acceptance it observes).

``prompts``: ``"humaneval"`` (default; pass@1 by running each problem's tests) or
``"code-heldout"``, the held-out package split of the shipped prompt corpus (whole packages the
distillation never saw; no tests, so pass@1 is not measured there).
Every row keeps its token ids, so the summary can say whether each method's output equals
greedy's token for token (it must: the methods are lossless).

With ``sampling`` (do_sample, temperature, top_k, top_p, min_p, seed: jacobi_ext.sampling) every
row samples: ``greedy`` / ``prompt-lookup`` then run transformers' sampling with the same filters
(the speed baseline; another draw of the same law), our methods sample with the seed, and
``identical`` compares each method with our ``ar`` sample (the same noise), which must be equal.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from jacobi_ext.data import humaneval_input_ids, load_humaneval
from jacobi_ext.decoding import generate
from jacobi_ext.decoding.baselines import hf_greedy, hf_sample

from .execution import check_completion

METHODS = ("greedy", "prompt-lookup", "ar", "ar-lookup", "jacobi", "multiblock",
           "multiblock-nolookup", "jacobi-tuned", "multiblock-tuned")  # fmt: skip
PROMPT_SETS = ("humaneval", "code-heldout")


def _done(path: Path) -> set[tuple[str, str]]:
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
) -> dict:
    from tqdm.auto import tqdm

    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"unknown eval method(s) {bad}: choose from {list(METHODS)}")
    path = Path(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = _done(path)
    probs = _problems(prompts, tokenizer)[offset:]
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
            # Held-out corpus prompts have no tests: pass@1 is HumanEval's alone.
            ok, why = check_completion(p, text, timeout) if "test" in p else (None, "no tests")
            row = {
                "task_id": p["task_id"], "method": m, "label": label, "tokens": int(toks.numel()),
                "forwards": forwards, "seconds": round(secs, 4), "passed": ok, "result": why,
                "block_size": block_size if m not in ("greedy", "prompt-lookup") else 1,
                "completion": text, "token_ids": toks.tolist(), "settings": used,
                "sampling": sampling or None,
            }  # fmt: skip
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
    return summarize(path)


def _problems(prompts: str, tokenizer) -> list[dict]:
    """The problems of a prompt set as dicts with ``task_id`` and ``input_ids`` (and HumanEval's
    fields, ``test`` among them, where the set is HumanEval)."""
    if prompts == "humaneval":
        return [{**p, "input_ids": humaneval_input_ids(tokenizer, p)} for p in load_humaneval()]
    if prompts == "code-heldout":
        from .prompts import load_prompts

        return [{"task_id": p.id, "input_ids": p.input_ids(tokenizer)}
                for p in load_prompts("code-heldout")]  # fmt: skip
    raise ValueError(f"unknown prompt set {prompts!r}: choose from {list(PROMPT_SETS)}")


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
            "identical": 1.0 if m == ref_m else ident,
        }
    return out


def _pass_at_1(rows) -> float | None:
    tested = [r["passed"] for r in rows if r["passed"] is not None]
    return sum(tested) / len(tested) if tested else None


def format_summary(s: dict) -> str:
    lines = [
        "| method | tasks | TPF | tokens/s | speedup vs HF greedy | pass@1 | identical to greedy |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in s.items():
        sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        lines.append(
            f"| {m} | {r['tasks']} | {_num(r['tpf'])} | {r['tokens_per_s']:.1f} | {sp} "
            f"| {_pct(r['pass@1'])} | {_ident(r.get('identical'))} |"
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
