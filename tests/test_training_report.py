"""The distill report: which models the scaling curve evaluates (and how many trajectories each
had seen), resumable measurement, the figures' content; the eval summary's speedup and
identical-to-greedy columns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from python_training import distill_report as dr
from python_training.evaluate import format_summary, summarize
from python_training.prompts import load_prompts


def fake_run(root: Path) -> Path:
    """Two stages: 6 steps × 2 examples (snapshots at 2, 4, 6 = final), 3 steps × 1 example."""
    for k, (name, steps, per, snaps) in enumerate(
        [("n16", 6, 2, [2, 4, 6]), ("n32", 3, 1, [2])], 1
    ):
        t = root / f"stage-{k}-{name}" / "train"
        t.mkdir(parents=True)
        rows = [{"step": s, "ar": 3.0 / s, "consistency": 2.0 / s, "examples": s * per}
                for s in range(1, steps + 1)]  # fmt: skip
        rows.insert(2, dict(rows[2], ar=99.0))  # step 3 logged twice (resume): last row wins
        (t / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
        for s in snaps:
            (t / "snapshots" / f"step-{s}").mkdir(parents=True)
            (t / "snapshots" / f"step-{s}" / "model.safetensors").write_text("x")
        (t / "final").mkdir()
        (t / "final" / "model.safetensors").write_text("x")
    return root


def test_read_log_keeps_last_row_and_skips_torn_line(tmp_path):
    run = fake_run(tmp_path)
    log = dr.read_log(run / "stage-1-n16" / "train" / "log.jsonl")
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert log[2]["ar"] == 1.0


def test_scaling_points_count_trajectories_across_stages(tmp_path):
    pts = dr.scaling_points(fake_run(tmp_path))
    got = [(p["label"], p["examples"], p["stage"]) for p in pts]
    assert got == [
        ("base", 0, 0),
        ("stage-1-n16/step-2", 4, 1),
        ("stage-1-n16/step-4", 8, 1),  # step-6 == final: not evaluated twice
        ("stage-1-n16/final", 12, 1),
        ("stage-2-n32/step-2", 14, 2),
        ("stage-2-n32/final", 15, 2),
    ]
    assert pts[0]["model"] is None and pts[-1]["model"].endswith("stage-2-n32/train/final")


def test_scaling_points_of_a_chunked_lora_run(tmp_path):
    """A LoRA run between chunks: adapter snapshots, no final model yet; the newest snapshot
    (at the last logged step) is a point, and x is the training tokens the log counted."""
    t = tmp_path / "stage-1-n16" / "train"
    t.mkdir(parents=True)
    rows = [{"step": s, "ar": 1.0, "consistency": 1.0, "examples": s, "tokens": 300,
             "tokens_seen": 300 * s} for s in range(1, 5)]  # fmt: skip
    (t / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for s in (2, 4):
        (t / "snapshots" / f"step-{s}").mkdir(parents=True)
        (t / "snapshots" / f"step-{s}" / "adapter_model.safetensors").write_text("x")
    got = [(p["label"], p["tokens"]) for p in dr.scaling_points(tmp_path)]
    assert got == [("base", 0), ("stage-1-n16/step-2", 600), ("stage-1-n16/step-4", 1200)]


def test_measure_scaling_resumes(tmp_path, monkeypatch):
    run = fake_run(tmp_path / "run")
    calls = []
    monkeypatch.setattr("jacobi_ext.models.load_model", lambda m: (m, None))

    def fake_tpf(model, tok, limit, max_new_tokens, block_size, sets):
        calls.append(model)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return {f"{w}/jacobi": {"tokens": 10, "forwards": 8, "tpf": 1.25} for w in sets}

    monkeypatch.setattr(dr, "heldout_tpf", fake_tpf)
    out = tmp_path / "scaling.jsonl"
    with pytest.raises(KeyboardInterrupt):
        dr.measure_scaling(run, out, limit=2, progress=False)
    assert len(dr.read_rows(out)) == 2
    rows = dr.measure_scaling(run, out, limit=2, progress=False)
    assert [r["label"] for r in rows] == [p["label"] for p in dr.scaling_points(run)]
    assert len(calls) == 3 + 4  # the interrupted model is redone, finished ones are not


def test_figures(tmp_path):
    import matplotlib.image as mpimg

    run = fake_run(tmp_path / "run")
    png = dr.plot_training(run, tmp_path / "t.png", smooth=2)
    assert mpimg.imread(png).shape[0] > 100
    rows = [dict(p, tpf=1.0 + 0.01 * p["examples"], prompts=2, max_new_tokens=8, block_size=4)
            for p in dr.scaling_points(run)]  # fmt: skip
    assert mpimg.imread(dr.plot_scaling(rows, tmp_path / "s.png")).shape[1] > 100
    rows[1]["tpf"] = float("nan")
    with pytest.raises(ValueError):
        dr.plot_scaling(rows, tmp_path / "s2.png")


def test_eval_summary_speedup_and_identity(tmp_path):
    rows = []
    for t, (g, j) in enumerate([([1, 2, 3], [1, 2, 3]), ([4, 5], [4, 6])]):
        rows.append({"task_id": f"T{t}", "method": "greedy", "tokens": len(g), "forwards": len(g),
                     "seconds": 1.0, "passed": t == 0, "token_ids": g})  # fmt: skip
        rows.append({"task_id": f"T{t}", "method": "jacobi", "tokens": len(j), "forwards": 1,
                     "seconds": 0.5, "passed": False, "token_ids": j})  # fmt: skip
        rows.append({"task_id": f"T{t}", "method": "prompt-lookup", "tokens": len(g),
                     "forwards": None, "seconds": 0.8, "passed": t == 0,
                     "token_ids": g})  # fmt: skip
    p = tmp_path / "r.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize(p)
    assert s["greedy"]["tpf"] == 1.0 and s["greedy"]["pass@1"] == 0.5
    assert s["jacobi"]["tpf"] == 2.5 and s["jacobi"]["speedup"] == pytest.approx(2.0)
    assert s["jacobi"]["identical"] == 0.5
    assert s["prompt-lookup"]["tpf"] is None and s["prompt-lookup"]["identical"] == 1.0
    assert s["prompt-lookup"]["speedup"] == pytest.approx(1.25)
    table = format_summary(s)
    assert "| prompt-lookup | 2 | - | 3.1 | 1.25x | 50.0% | yes |" in table
    assert "no (50% of tasks)" in table and "| greedy | 2 | 1.00 |" in table
    # A results file committed gzipped reads the same.
    import gzip

    gz = tmp_path / "r.jsonl.gz"
    gz.write_bytes(gzip.compress(p.read_bytes()))
    assert summarize(gz) == s


def test_measure_scaling_completes_older_rows(tmp_path, monkeypatch):
    """A row measured before a set was added gets that set alone; its other figures stay."""
    run = fake_run(tmp_path / "run")
    monkeypatch.setattr("jacobi_ext.models.load_model", lambda m: (m, None))
    calls = []

    def fake_tpf(model, tok, limit, max_new_tokens, block_size, sets):
        calls.append(tuple(sets))
        return {f"{w}/jacobi": {"tokens": 10, "forwards": 5, "tpf": 2.0} for w in sets}

    monkeypatch.setattr(dr, "heldout_tpf", fake_tpf)
    out = tmp_path / "scaling.jsonl"
    dr.measure_scaling(run, out, limit=2, progress=False, sets=("humaneval",))
    before = dr.read_rows(out)
    calls.clear()
    rows = dr.measure_scaling(run, out, limit=2, progress=False, sets=("humaneval", "code"))
    assert calls == [("code",)] * len(before)
    assert [r["label"] for r in rows] == [r["label"] for r in before]
    for old, new in zip(before, rows, strict=True):
        assert new["humaneval/jacobi"] == old["humaneval/jacobi"]
        assert new["code/jacobi"]["tpf"] == 2.0
    calls.clear()
    dr.measure_scaling(run, out, limit=2, progress=False, sets=("humaneval", "code"))
    assert calls == []  # nothing left to measure
    # rows of another prompt count or length are never mixed with new figures
    dr.measure_scaling(run, out, limit=3, progress=False, sets=("humaneval", "code", "x"))
    assert calls == []


def test_eval_methods_and_heldout_prompts_end_to_end(tmp_path):
    """`evaluate` on a tiny random Llama with SmolLM2's tokenizer: HumanEval rows run the tests
    (pass@1), held-out corpus rows have none (pass@1 '-'), `multiblock-nolookup` decodes without
    the lookup row, every method equals greedy, and a rerun resumes instead of repeating."""
    from transformers import AutoTokenizer

    from jacobi_ext.models import default_model_file, tiny_llama
    from python_training.evaluate import evaluate

    path = default_model_file()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = tiny_llama(vocab_size=len(tok), eos_token_id=tok.eos_token_id, seed=1).eval()
    methods = ("greedy", "jacobi", "multiblock-nolookup", "multiblock", "ar-lookup")
    kw = dict(methods=methods, limit=2, max_new_tokens=12, block_size=4, progress=False)
    he = evaluate(model, tok, tmp_path / "he.jsonl", **kw)
    held = evaluate(model, tok, tmp_path / "held.jsonl", prompts="code-heldout", **kw)
    for s in (he, held):
        assert set(s) == set(methods)
        assert all(r["tasks"] == 2 and r["identical"] == 1.0 for r in s.values())
    assert he["greedy"]["pass@1"] == 0.0  # random weights: code that fails its tests
    assert held["greedy"]["pass@1"] is None and "| - |" in format_summary(held)
    rows = [json.loads(x) for x in (tmp_path / "held.jsonl").read_text().splitlines()]
    assert {r["task_id"] for r in rows} <= {p.id for p in load_prompts("code-heldout")}
    settings = {r["method"]: r["settings"] for r in rows}
    assert "lookup" not in settings["multiblock-nolookup"], settings
    assert settings["ar-lookup"].startswith("ar+lookup n=1"), settings
    n = len(rows)
    evaluate(model, tok, tmp_path / "held.jsonl", prompts="code-heldout", **kw)
    assert len((tmp_path / "held.jsonl").read_text().splitlines()) == n
    with pytest.raises(ValueError, match="choose from"):
        evaluate(model, tok, tmp_path / "x.jsonl", methods=("beam",), limit=1)
    with pytest.raises(ValueError, match="prompt set"):
        evaluate(model, tok, tmp_path / "x.jsonl", prompts="mbpp", limit=1)
