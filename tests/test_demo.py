"""The README's main job, `jacobi-forcing demo`: which checkpoint it picks up, and (slow) a
short real run on SmolLM2 whose results file holds the three methods, all identical to greedy."""

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


@pytest.mark.slow
def test_demo_runs_and_is_lossless(tmp_path, monkeypatch):
    from jacobi_ext.cli import main

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


def test_shipped_adapter_loads_without_warnings():
    """`load_model("smollm2-jf")` (offline) gives the base model on its GGUF codes with the
    shipped LoRA unmerged on top; with dequantize=True a plain transformers model, the adapter
    merged. No deprecation warning reaches the user either way (peft's call of a deprecated
    transformers method is ours to hide: the user cannot change it)."""
    import warnings

    from jacobi_ext.models import ADAPTERS, DISTILLED_MODEL, load_model
    from jacobi_ext.quantized import GGUFLinear, describe

    if not (ADAPTERS[DISTILLED_MODEL] / "adapter_model.safetensors").is_file():
        pytest.fail("the distilled adapter is not in the checkout")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        model, _ = load_model(DISTILLED_MODEL)
        merged, _ = load_model(DISTILLED_MODEL, dequantize=True)
    q = model.model.layers[0].self_attn.q_proj
    # q/k/v share one fused LoRA: rank 3 x 16 (A stacked, B block-diagonal)
    assert isinstance(q, GGUFLinear) and q.lora is not None and q.lora.rank == 3 * 16
    down = model.model.layers[0].mlp.down_proj
    assert down.group is None and down.lora.rank == 16
    assert describe(model) == "Q4_1 x 210, Q8_0 x 1 + LoRA (unmerged)"
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert not any("lora" in n for n, _ in merged.named_parameters())
