"""Jacobi trajectory collection (docs/method.md §2) and its on-disk format.

Format (schema_version 1): a directory holding
  ``meta.json``            what produced the data: teacher, block_size, max_new_tokens, eos_ids,
                           pad_id, dtype, schema_version. A resumed run must match it.
  ``trajectories*.jsonl``  one JSON record per line, one line per prompt (several files when
                           collection is sharded across processes; readers take them all):
    {"schema_version": 1, "id": str, "prompt_ids": [int],
     "block_size": n, "eos_ids": [int], "pad_id": int,
     "blocks": [[state, ...], ...],  # per n-token block, every Jacobi iteration's state,
                                     # n ints each (PAD after the first EOS), the last one
                                     # the fixed point (= greedy's tokens)
     "new_tokens": int, "forwards": int, "seconds": float, "finished": bool}  # EOS reached

Appendable and resumable: a record is one ``write`` of one line, flushed and fsync'ed before the
next prompt starts, so an interruption loses at most the prompt in flight. On restart the
files are read, a torn last line (a crash mid-write) is cut off, and prompts whose id is
already present are skipped: nothing is duplicated or lost.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from jacobi_ext.decoding import generate, left_pad
from jacobi_ext.decoding.engine import TrajectoryRecorder, eos_ids

from .packing import pad_after_eos
from .prompts import Prompt

SCHEMA_VERSION = 1
META = "meta.json"
_META_KEYS = (
    "schema_version",
    "teacher",
    "block_size",
    "max_new_tokens",
    "eos_ids",
    "pad_id",
    "dtype",
    "states",
)


def _repair_and_read(path: Path) -> list[dict]:
    """Records of one JSONL file; a torn (unterminated or unparsable) last line is truncated."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # everything after the last newline is a torn write
    records = []
    for line in data[:end].splitlines():
        if line.strip():
            records.append(json.loads(line))
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    return records


def read_trajectories(directory: str | Path) -> list[dict]:
    """All records of a trajectory directory (every shard, and ``trajectories*.jsonl.gz``:
    collections shipped compressed in the repo), in file then line order."""
    import gzip

    d = Path(directory)
    out = []
    for p in sorted(d.glob("trajectories*.jsonl*")):
        if p.suffix == ".gz":
            with gzip.open(p, "rt", encoding="utf-8") as f:
                out += [json.loads(line) for line in f if line.strip()]
        elif p.suffix == ".jsonl":
            out += _repair_and_read(p)
    for r in out:
        if r.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"{d}: record schema {r.get('schema_version')} != {SCHEMA_VERSION}")
    return out


def _check_meta(d: Path, meta: dict) -> None:
    path = d / META
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), meta.get(k)) for k in _META_KEYS if old.get(k) != meta.get(k)}
        if diff:
            raise ValueError(
                f"{d} holds trajectories collected with other settings {diff} "
                "(old, new): use another directory"
            )
    else:
        d.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        os.replace(tmp, path)


def make_record(
    pid: str,
    prompt_ids: Sequence[int],
    blocks: list[list[list[int]]],
    n: int,
    eos_ids: set[int],
    pad_id: int,
    **extra,
) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "id": pid,
        "prompt_ids": list(prompt_ids),
        "block_size": n,
        "eos_ids": sorted(eos_ids),
        "pad_id": pad_id,
        # Each state a fresh list (the recorder already copies; this also pads the EOS block).
        "blocks": [[pad_after_eos(s, n, eos_ids, pad_id) for s in states] for states in blocks],
        **extra,
    }


def collect(
    model,
    tokenizer,
    prompts: Sequence[Prompt],
    out_dir: str | Path,
    block_size: int,
    max_new_tokens: int,
    teacher: str = "",
    shard: tuple[int, int] = (0, 1),
    max_prompt_tokens: int | None = None,
    progress: bool = True,
    encode: Callable[[Prompt], torch.Tensor] | None = None,
    fixed_points_only: bool = False,
    batch_size: int = 1,
) -> dict:
    """Collect the teacher's Jacobi trajectories for ``prompts`` into ``out_dir`` (resumable).

    ``max_new_tokens`` must be a multiple of ``block_size`` (a cap never cuts a block). With
    ``shard=(k, N)`` this process takes prompts k, k+N, ... and writes its own file.
    ``fixed_points_only``: decode greedily with KV-cached AR instead of Jacobi (several times
    faster on a CPU, where Jacobi's TPF ≈ 1) and store each block as its fixed point alone
    (one state per block): the data for synthetic noise (packing.synthetic_state), which needs
    nothing else. ``meta.json`` records it (``"states": "fixed_point"``).
    ``batch_size``: decode that many prompts together, left-padded, one forward per step for
    the batch (``generate(..., attention_mask=)``), fixed points and Jacobi trajectories alike;
    each record is that prompt's own (batch-1) answer and trajectory, and the batch's records
    are written when it finishes.
    Returns a summary (prompts done now / before, tokens, seconds).
    """
    from tqdm.auto import tqdm

    n = block_size
    if max_new_tokens % n:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) must be a multiple of n ({n})")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    d = Path(out_dir)
    eos = eos_ids(model, tokenizer=tokenizer)
    pad = tokenizer.pad_token_id if tokenizer is not None else None
    pad = pad if pad is not None else (min(eos) if eos else 0)
    meta = {
        "schema_version": SCHEMA_VERSION,
        "teacher": str(teacher),
        "block_size": n,
        "max_new_tokens": max_new_tokens,
        "eos_ids": sorted(eos),
        "pad_id": int(pad),
        "dtype": str(next(model.parameters()).dtype),
    }
    if fixed_points_only:
        meta["states"] = "fixed_point"
    _check_meta(d, meta)
    k, N = shard
    path = d / (f"trajectories-{k:03d}-of-{N:03d}.jsonl" if N > 1 else "trajectories.jsonl")
    done = {r["id"] for r in read_trajectories(d)}
    todo = [p for i, p in enumerate(prompts) if i % N == k and p.id not in done]
    encode = encode or (lambda p: p.input_ids(tokenizer))
    device = next(model.parameters()).device
    summary = {"before": len(done), "collected": 0, "skipped_long": 0, "tokens": 0, "seconds": 0.0}
    bar = tqdm(total=len(todo), desc=f"collect n={n}", unit="prompt", disable=not progress)
    t_start = time.perf_counter()

    def decode(batch: list[tuple[Prompt, torch.Tensor]]) -> list[tuple[list, int, list, float]]:
        """(blocks, forwards, answer tokens, seconds) per prompt of the batch: one forward per
        step for the whole batch, each prompt's record its own (batch-1) greedy answer."""
        x, mask = left_pad([ids[0] for _, ids in batch], int(pad))
        kw = dict(attention_mask=mask.to(device), max_new_tokens=max_new_tokens, lookup=False,
                  pad_token_id=int(pad))  # fmt: skip
        if fixed_points_only:
            res = generate(model, x.to(device), method="ar", **kw)
        else:
            recs = [TrajectoryRecorder() for _ in batch]
            res = generate(model, x.to(device), method="jacobi", block_size=n, trajectory=recs,
                           **kw)  # fmt: skip
        lengths = res.lengths or [int(res.tokens.shape[-1])]
        secs = (res.seconds + res.prefill_seconds) / len(batch)  # the batch's time, shared
        out = []
        for j, length in enumerate(lengths):
            toks = res.tokens[j, :length].tolist()
            if fixed_points_only:
                blocks = [[toks[i : i + n]] for i in range(0, len(toks), n)]
                out.append((blocks, res.forwards, toks, secs))
            else:
                out.append((recs[j].blocks, recs[j].forwards, toks, secs))
        return out

    with open(path, "ab") as f:
        pending: list[tuple[Prompt, torch.Tensor]] = []
        for i, p in enumerate(todo):
            ids = encode(p)
            if max_prompt_tokens is not None and ids.shape[1] > max_prompt_tokens:
                summary["skipped_long"] += 1
                bar.update(1)
            else:
                pending.append((p, ids))
            if len(pending) < batch_size and i + 1 < len(todo):
                continue
            if not pending:
                continue
            for (pr, ids), (blocks, fwd, toks, secs) in zip(pending, decode(pending), strict=True):
                record = make_record(
                    pr.id,
                    ids[0].tolist(),
                    blocks,
                    n,
                    eos,
                    int(pad),
                    new_tokens=len(toks),
                    forwards=fwd,
                    seconds=round(secs, 4),
                    finished=bool(toks and toks[-1] in eos),
                )
                # One write + fsync per record: an interruption loses at most the batch in flight.
                f.write((json.dumps(record, separators=(",", ":")) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
                summary["collected"] += 1
                summary["tokens"] += len(toks)
            bar.update(len(pending))
            pending = []
            el = time.perf_counter() - t_start
            bar.set_postfix(tok_s=f"{summary['tokens'] / el:.1f}")
    bar.close()
    summary["seconds"] = time.perf_counter() - t_start
    return summary
