"""The model families (jacobi_ext/models/families): each declared once, read by the executors.
What each family's declaration says is checked against transformers' own modules, and which
families each executor runs is what `jacobi-forcing info` lists."""

from __future__ import annotations

import pytest
import torch

from jacobi_ext.apps.cli import main
from jacobi_ext.decoding import lean
from jacobi_ext.models import tiny_llama
from jacobi_ext.models.families import FAMILIES, family_of, supported_classes


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_a_tiny_model_of_each_family_is_recognised_and_runs_the_lean_forward(name):
    model = tiny_llama(vocab_size=101, hidden_size=64, num_heads=4, num_kv_heads=2, family=name)
    fam = family_of(model)
    assert fam is FAMILIES[name]
    attn = model.model.layers[0].self_attn
    assert len(list(attn.children())) == fam.attention_modules
    assert hasattr(attn, "q_norm") == fam.qk_norm
    with torch.inference_mode():
        assert lean.why_not(model) is None
        dec = lean.lean_decoder(model)
    assert (dec.plans[0].qk_norm is not None) == fam.qk_norm


def test_every_family_names_its_classes_and_gguf_architectures():
    assert set(supported_classes()) >= {
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    }  # fmt: skip
    for fam in FAMILIES.values():
        assert fam.classes and fam.gguf_architectures
    classes = [c for f in FAMILIES.values() for c in f.classes]
    assert len(classes) == len(set(classes)), "a class belongs to one family"


def test_an_undeclared_q_k_norm_is_refused():
    """A Llama-class model whose attention grew q/k norms is not a Llama layer: refused with a
    reason, so it runs transformers' forward rather than a wrong fused one."""
    model = tiny_llama(vocab_size=101, hidden_size=64, num_heads=4, num_kv_heads=2)
    attn = model.model.layers[0].self_attn
    attn.q_norm = type(model.model.norm)(16)
    assert "does not declare" in lean.why_not(model)


def test_info_lists_the_families_each_executor_runs(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "model families" in out
    for name in FAMILIES:
        assert name in out
