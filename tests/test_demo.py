"""The README's main job, `jacobi-forcing demo`: which checkpoint it picks up, its table in an
80-column terminal, and (slow) a short real run on SmolLM2 whose results file holds the three
methods, all identical to greedy."""

from __future__ import annotations

import json
import math
import os
import time

import pytest

from jacobi_ext.models import find_distilled


def test_find_distilled_picks_the_newest_recipe_output(tmp_path):
    assert find_distilled(tmp_path / "runs") is None
    for i, name in enumerate(["old", "new"]):
        d = tmp_path / "runs" / name / "final"
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        os.utime(d / "config.json", (time.time() - 100 + i * 50,) * 2)
    (tmp_path / "runs" / "half" / "final").mkdir(parents=True)  # no config: not a checkpoint
    assert find_distilled(tmp_path / "runs") == tmp_path / "runs" / "new" / "final"


def _fake_rows(sampled: bool, shown: str = "smollm2-jf") -> list[dict]:
    """demo_results.json rows as a full demo writes them (every method, wide numbers, the
    longest settings the tuner can choose for the demo's K=2 p=4), no model needed."""
    hf = "transformers sampling" if sampled else "transformers greedy"
    q = "GGUF Q4_1+Q8_0 +LoRA"
    rows = [("base", "float32", hf, "-"), (shown, q, hf, "-")]
    rows += [(shown, q, "ar (the reference sample)", "ar n=1 K=1 p=0")] if sampled else []
    rows += [
        (shown, q, "jacobi n=16", "jacobi n=16 K=1 p=0"),
        (shown, q, "multiblock (tuned)", "multiblock+lookup n=64 K=2 p=4"),
    ]
    return [
        dict(
            model=m,
            weights=w,
            method=name,
            settings=st,
            tokens_per_s=12345.6 / (i + 1),
            tpf=12.34,
            speedup=123.45,
            identical=i != 1,
        )  # fmt: skip
        for i, (m, w, name, st) in enumerate(rows)
    ]


@pytest.mark.parametrize(
    "sampled, shown", [(False, "smollm2-jf"), (True, "smollm2-jf"), (False, "runs/x/final")]
)
def test_demo_table_fits_80_columns(monkeypatch, sampled, shown):
    """The table a full demo prints fits an 80-column terminal (rich reads COLUMNS): no cell
    cut ('…'), one line a row; the legend under it spells out every short label."""
    import io

    from rich.console import Console
    from rich.text import Text

    from jacobi_ext.apps.demo import results_table

    monkeypatch.setenv("COLUMNS", "80")
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False)
    assert console.width == 80
    rows = _fake_rows(sampled, shown)
    title = "164 HumanEval prompts, 1024 new tokens max, bfloat16"
    table, legend = results_table(rows, title, "AMD EPYC 7B13 64-Core Processor", sampled)
    console.print(table)
    console.print(legend)
    out = buf.getvalue()
    assert "…" not in out
    lines = out.splitlines()
    assert all(Text(line).cell_len <= 80 for line in lines)
    body = [line for line in lines if line.startswith("│")]
    assert len(body) == len(rows)  # one line a row: no cell wrapped onto a second line
    assert sum(line.startswith("┃") for line in lines) == 1  # the header, one line too
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in body]
    assert cells[-1][2] == "n=64 K=2 p=4 +lookup" and cells[-1][-1] == "yes"
    assert cells[1][-1] == "NO"
    legend_labels = {line.split()[0] for line in lines[lines.index(body[-1]) + 1 :] if line}
    for row in cells:
        assert {row[0], row[1]} <= legend_labels
    assert {"settings", "TPF", "lossless"} <= legend_labels
    assert shown in out  # the legend names the model the short label stands for


def test_demo_table_settings_name_the_method_the_tuner_chose():
    from jacobi_ext.apps.demo import _short_settings

    assert _short_settings("multiblock n=16 K=2 p=4", "multiblock") == "n=16 K=2 p=4"
    assert _short_settings("ar+lookup n=1 K=1 p=0", "multiblock") == "ar +lookup"
    assert _short_settings("jacobi+lookup n=32 K=1 p=0", "multiblock") == "jacobi n=32 +lookup"
    assert _short_settings("jacobi n=16 K=1 p=0", "jacobi") == "n=16"
    assert _short_settings("ar n=1 K=1 p=0", "ar") == "-"
    assert _short_settings("-", None) == "-"


@pytest.mark.slow
def test_demo_runs_and_is_lossless(tmp_path, monkeypatch):
    from jacobi_ext.apps.cli import main

    monkeypatch.setenv("JACOBI_EXT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "demo"
    rc = main(["demo", "--prompts", "1", "--max-new-tokens", "24", "--quiet", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "demo_results.json").read_text())
    from jacobi_ext.models import ADAPTERS, DISTILLED_MODEL

    shipped = (ADAPTERS[DISTILLED_MODEL] / "adapter_model.safetensors").is_file()
    shown = DISTILLED_MODEL if shipped else "base"
    expect = [("base", "transformers greedy")]
    expect += [(shown, "transformers greedy")] if shipped else []
    expect += [(shown, "jacobi n=16"), (shown, "multiblock (tuned)")]
    assert [(r["model"], r["method"]) for r in res["rows"]] == expect
    for r in res["rows"]:
        assert r["identical"] is True
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("tokens_per_s", "tpf", "speedup"))
    assert (out / "forward_latency_vs_tokens.png").stat().st_size > 10_000
    assert res["curve"]["sizes"][0] == 1 and len(res["curve"]["seconds"]) >= 8
    modes = res["modes"]  # which CPU mode is faster here, both timed
    assert modes["exact_ms"] > 0 and modes["int8_ms"] > 0 and modes["why_not"] is None
    faster = "int8" if modes["int8_ms"] < modes["exact_ms"] else "exact"
    assert modes["faster"] == faster and modes["speedup"] >= 1


def test_shipped_adapter_loads_without_warnings():
    """`load_model("smollm2-jf")` (offline) gives the base model on its GGUF codes with the
    shipped LoRA unmerged on top; with dequantize=True a plain transformers model, the adapter
    merged. No deprecation warning reaches the user either way (peft's call of a deprecated
    transformers method is ours to hide: the user cannot change it)."""
    import warnings

    import torch

    from jacobi_ext.models import ADAPTERS, DISTILLED_MODEL, load_model
    from jacobi_ext.models.quantized import GGUFLinear, describe

    if not (ADAPTERS[DISTILLED_MODEL] / "adapter_model.safetensors").is_file():
        pytest.fail("the distilled adapter is not in the checkout")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        model, _ = load_model(DISTILLED_MODEL)
        merged, _ = load_model(DISTILLED_MODEL, dequantize=True)
    q = model.model.layers[0].self_attn.q_proj
    # q/k/v share one fused LoRA: A stacked (3 x 16 rows, in panels of nr: 48 -> 64 where nr is
    # 32), each panel of B reads its own 16 columns of x A^T (q's from 0, k's from 16, v's from 32)
    assert isinstance(q, GGUFLinear) and q.lora is not None and q.lora.rank == 16
    nr = q.lora.a.shape[2]
    assert q.lora.a.shape[0] == -(-3 * 16 // nr)
    assert q.lora.a.dtype == q.lora.b.dtype == torch.bfloat16  # the adapter's stored dtype
    k = model.model.layers[0].self_attn.k_proj
    assert set(q.lora.panel_r0.tolist()) == {0} and set(k.lora.panel_r0.tolist()) == {16}
    down = model.model.layers[0].mlp.down_proj
    assert down.group is None and down.lora.rank == 16
    assert describe(model) == "Q4_1 x 210, Q8_0 x 1 + LoRA (unmerged)"
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert not any("lora" in n for n, _ in merged.named_parameters())
