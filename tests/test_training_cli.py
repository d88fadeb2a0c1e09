"""The distillation commands exist with --help, and every shipped recipe parses into valid
training configs (unknown keys are errors, so a typo in a recipe fails here, not hours in)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jacobi_ext.apps.cli import main
from python_training.distill import load_recipe
from python_training.trainer import TrainConfig

RECIPES = sorted((Path(__file__).parents[1] / "python_training" / "recipes").glob("*.toml"))


COMMANDS = ["collect", "train", "distill", "eval", "fidelity", "distill-report"]
# Every subcommand, in the order `jacobi-forcing --help` lists them: python_training's come
# through the entry point of pyproject.toml, between tune and export.
ORDER = ["demo", "generate", "tune", "prompts", "collect", "train", "distill", "eval", "fidelity",
         "distill-report", "gpu-run", "export", "bench", "info"]  # fmt: skip


def test_help_lists_every_command_in_order(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    # One line per command, its name indented by 4 (wrapped help lines are indented further).
    listed = re.findall(r"^ {4}([a-z][\w-]*)", out[out.index("commands:") :], re.M)
    assert listed == ORDER, out


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    assert "usage: jacobi-forcing " + cmd in capsys.readouterr().out


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipes_parse(path):
    r = load_recipe(path)
    for st in r["stages"]:
        assert st["max_new_tokens"] % st["block_size"] == 0
        TrainConfig.from_dict(dict(st.get("train", {})))
    assert len(RECIPES) >= 3


def test_unknown_train_key_is_an_error():
    with pytest.raises(ValueError, match="unknown"):
        TrainConfig.from_dict({"learning_rate": 1e-5})


def test_train_flags_reach_the_config(monkeypatch, tmp_path, capsys):
    """The chunked run's flags (--warmup-ratio, --stop-after-minutes, LoRA, adapter_out) land
    in TrainConfig, and a flag overrides the same key of --config."""
    import json

    import python_training.trainer as trainer

    got = {}
    monkeypatch.setattr(trainer, "train", lambda cfg: got.setdefault("cfg", cfg) and {})
    conf = tmp_path / "c.json"
    conf.write_text(json.dumps({"warmup_ratio": 0.5, "window": 8}))
    main(["train", "--data", "d", "--config", str(conf), "--warmup-ratio", "0.02",
          "--stop-after-minutes", "45", "--lora-rank", "16", "--adapter-out", "a",
          "--random-phase", "--no-ar-prompt"])  # fmt: skip
    cfg = got["cfg"]
    assert (cfg.warmup_ratio, cfg.stop_after_minutes, cfg.window) == (0.02, 45.0, 8)
    assert (cfg.lora_rank, cfg.adapter_out, cfg.random_phase, cfg.data) == (16, "a", True, ["d"])
    assert cfg.ar_prompt is False and TrainConfig().ar_prompt is True  # docs/method.md §3 default


@pytest.mark.parametrize(
    "argv",
    [
        ["collect", "--out", "o", "--limit", "1"],
        ["eval", "--results", "r.jsonl", "--limit", "1"],
        ["fidelity", "--reference", "r.jsonl"],
    ],
    ids=lambda a: a[0],
)
@pytest.mark.parametrize("dequantize", [False, True])
def test_dequantize_reaches_the_loader(monkeypatch, tmp_path, argv, dequantize):
    """collect, eval and fidelity take --dequantize (a GGUF teacher in fp32, as transformers
    loads it) and pass it to load_model; without it the default (the codes on a CPU)."""
    import jacobi_ext.models
    import python_training.fidelity

    got = {}

    class Loaded(Exception):
        pass

    def load_model(*args, **kwargs):
        got.update(kwargs)
        raise Loaded

    monkeypatch.setattr(jacobi_ext.models, "load_model", load_model)
    monkeypatch.setattr(python_training.fidelity, "reference_rows", lambda *a: [])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Loaded):
        main(argv + (["--dequantize"] if dequantize else []))
    assert got["dequantize"] is (True if dequantize else None)
