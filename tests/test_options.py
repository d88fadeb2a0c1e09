"""The engine's switches, read in one place (jacobi_ext/decoding/options.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jacobi_ext.decoding.options import VARIABLES, Options, options

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def clean_env(monkeypatch):
    for v in VARIABLES:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_unset_is_every_default(clean_env):
    assert options() == Options()


@pytest.mark.parametrize("word", ["0", "off", "OFF", " false ", "no"])
def test_each_off_word_turns_a_switch_off(clean_env, word):
    for var, field in [("JACOBI_EXT_LEAN", "lean"), ("JACOBI_EXT_FUSED", "fused"),
                       ("JACOBI_EXT_NATIVE", "native"),
                       ("JACOBI_EXT_GREEDY_SCREEN", "greedy_screen"),
                       ("JACOBI_EXT_CPU_PREPACK", "cpu_prepack")]:  # fmt: skip
        clean_env.setenv(var, word)
        assert getattr(options(), field) is False, var
        clean_env.setenv(var, "1")
        assert getattr(options(), field) is True, var
    clean_env.setenv("JACOBI_EXT_CUDA_GRAPHS", word)
    assert options().cuda_graphs is None
    clean_env.setenv("JACOBI_EXT_CPU_LINEAR", word)
    assert options().cpu_linear == "off"


@pytest.mark.parametrize(
    "value, want",
    [("1", "capture"), ("capture", "capture"), ("Compile", "compile"), ("yes", "capture")],
)
def test_cuda_graph_modes(clean_env, value, want):
    clean_env.setenv("JACOBI_EXT_CUDA_GRAPHS", value)
    assert options().cuda_graphs == want


@pytest.mark.parametrize(
    "value, want", [("kernel", "kernel"), ("onednn", "onednn"), ("auto", "auto"), ("x", "auto")]
)
def test_cpu_linear_choices(clean_env, value, want):
    clean_env.setenv("JACOBI_EXT_CPU_LINEAR", value)
    assert options().cpu_linear == want


def test_prefill_chunk(clean_env):
    clean_env.setenv("JACOBI_EXT_PREFILL_CHUNK", "32")
    assert options().prefill_chunk == 32
    clean_env.setenv("JACOBI_EXT_PREFILL_CHUNK", " ")
    assert options().prefill_chunk is None
    for bad in ("-1", "many"):
        clean_env.setenv("JACOBI_EXT_PREFILL_CHUNK", bad)
        with pytest.raises(ValueError, match="token count >= 0"):
            options()


def test_no_other_module_reads_the_engines_switches():
    """Every JACOBI_EXT_* variable the engine reads is one of options.VARIABLES, and only
    options.py reads the environment for them."""
    read = re.compile(r"(os\.environ|getenv|env_off)[^\n]*JACOBI_EXT_|JACOBI_EXT_\w+\"\s*\)")
    for path in sorted((ROOT / "jacobi_ext" / "decoding").glob("*.py")):
        if path.name == "options.py":
            continue
        assert not read.search(path.read_text()), f"{path.name} reads a switch itself"
