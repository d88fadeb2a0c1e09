"""Sampling on the command line: `generate`, `demo` and `eval` take --do-sample and
transformers' filter names; eval's summary compares sampled methods with our AR sample."""

from __future__ import annotations

import json
import math

import pytest

from jacobi_ext.apps.cli import build_parser, sampling_kwargs


def test_generate_and_demo_parse_sampling_options() -> None:
    p = build_parser()
    argv = ["generate", "--prompt", "hi", "--do-sample", "--temperature", "0.7", "--top-p",
            "0.9", "--top-k", "0", "--min-p", "0.05", "--seed", "3"]  # fmt: skip
    a = p.parse_args(argv)
    assert sampling_kwargs(a) == dict(do_sample=True, temperature=0.7, top_k=0, top_p=0.9,
                                      min_p=0.05, seed=3)  # fmt: skip
    g = p.parse_args(["generate", "--prompt", "hi"])
    assert sampling_kwargs(g) == {"seed": None}  # greedy: generate's default seed
    d = p.parse_args(["demo", "--do-sample", "--temperature", "1.0"])
    assert sampling_kwargs(d)["do_sample"] and sampling_kwargs(d)["temperature"] == 1.0
    e = p.parse_args(["eval", "--results", "r.jsonl", "--do-sample", "--top-p", "0.9"])
    from python_training.cli import _sampling

    assert _sampling(e) == dict(do_sample=True, temperature=None, top_k=None, top_p=0.9,
                                min_p=None, seed=0)  # fmt: skip


def test_eval_summary_under_sampling(tmp_path) -> None:
    """Sampled rows: identity against our `ar` sample; transformers' rows are other draws."""
    from python_training.evaluate import summarize

    samp = {"do_sample": True, "temperature": 0.7, "seed": 0}
    rows = []
    for t, (h, a, j) in enumerate([([1, 2], [1, 3], [1, 3]), ([4, 5], [4, 6, 7], [4, 6, 8])]):
        for m, ids, fw, sec in [("greedy", h, len(h), 1.0), ("ar", a, len(a), 1.0),
                                ("jacobi", j, 1, 0.5)]:  # fmt: skip
            rows.append({"task_id": f"T{t}", "method": m, "tokens": len(ids), "forwards": fw,
                         "seconds": sec, "passed": m == "ar", "token_ids": ids,
                         "sampling": samp})  # fmt: skip
    p = tmp_path / "r.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize(p)
    assert s["ar"]["identical"] == 1.0 and s["jacobi"]["identical"] == 0.5
    assert s["greedy"]["identical"] is None  # transformers' sample: not ours
    assert s["ar"]["pass@1"] == 1.0 and s["jacobi"]["tpf"] == 2.5


@pytest.mark.slow
def test_sampled_demo_is_lossless_to_its_ar_sample(tmp_path, monkeypatch) -> None:
    from jacobi_ext.apps.cli import main

    monkeypatch.setenv("JACOBI_EXT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "demo"
    rc = main(["demo", "--prompts", "1", "--max-new-tokens", "24", "--quiet", "--out", str(out),
               "--do-sample", "--temperature", "0.7", "--top-p", "0.9", "--seed", "5"])  # fmt: skip
    assert rc == 0
    res = json.loads((out / "demo_results.json").read_text())
    methods = [r["method"] for r in res["rows"]]
    assert methods[0] == "transformers sampling" and "ar (the reference sample)" in methods
    assert all(r["identical"] for r in res["rows"])
    assert all(math.isfinite(r["tpf"]) and r["tpf"] > 0 for r in res["rows"])
    assert res["sampling"]["seed"] == 5 and res["sampling"]["top_p"] == 0.9
