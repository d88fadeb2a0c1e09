"""What a kept runtime's captured steps read stays alive and current (runtime.StaticRuntime:
step_reads, _pick_forward; lean.LeanDecoder: _rope_tables, norm_weight).

A CUDA graph replays reads from the addresses it was captured with. These tests run on the CPU,
where nothing is captured, and check the bookkeeping that keeps those addresses valid: the rotary
tables belong to the runtime and are never replaced (a larger probe used to regrow a table kept
on the model's lean decoder and free the one the kept runtime's graphs gathered from), and a
runtime whose forward or weights changed (an adapter wrapped or unloaded) drops its graphs
before the next step. Plus: norm weights kept in float32 beside bfloat16 linears."""

from __future__ import annotations

import copy

import pytest
import torch

from jacobi_ext.decoding.engine import generate
from jacobi_ext.decoding.runtime import StepProbe
from jacobi_ext.models import tiny_llama

PROMPT = torch.tensor([[5, 17, 3, 44, 9, 71, 2, 30]])


def _model(dtype=torch.float32):
    # head dim 32: the lean forward's own rotary tables (lean.STATIC_ROPE, 32 lanes)
    return tiny_llama(
        vocab_size=101, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, dtype=dtype
    ).eval()


def _run(model, method="jacobi", **kw):
    return generate(model, PROMPT, max_new_tokens=16, method=method, block_size=4, **kw).tokens


def test_a_larger_probe_leaves_the_kept_runtimes_reads_alone():
    model = _model()
    first = _run(model)
    rt = model._jacobi_runtime
    assert rt.rope_tables, "the lean forward gathers rotary rows from the runtime's tables"
    tables = {k: tuple(t.data_ptr() for t in v) for k, v in rt.rope_tables.items()}
    reads = rt.step_reads()
    probe = StepProbe(model, context=rt.capacity + 300, max_q=32)  # more positions than rt's
    probe(8)
    assert probe.rt is not rt and probe.rt.capacity > rt.capacity
    again = _run(model)
    assert model._jacobi_runtime is rt, "the call reuses the kept runtime"
    assert {k: tuple(t.data_ptr() for t in v) for k, v in rt.rope_tables.items()} == tables
    assert rt.step_reads() == reads
    assert torch.equal(again, first)


class _Captured:
    """Stands in for a captured graph: the runtime keeps or drops it, nothing replays it."""


def _fake_capture(rt) -> None:
    rt._graphs["probe"] = (_Captured(), None)
    rt._captured_reads = rt.step_reads()


def test_graphs_are_dropped_when_the_forward_or_its_weights_change():
    from peft import LoraConfig, get_peft_model

    model = _model()
    _run(model)
    rt = model._jacobi_runtime
    _fake_capture(rt)
    _run(model)  # nothing changed: the graphs stay
    assert "probe" in rt._graphs

    # An adapter wrapped in place: the layers' linears become LoRA modules (another forward).
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(model, cfg)
    wrapped = _run(model)
    assert model._jacobi_runtime is rt and "probe" not in rt._graphs
    assert torch.equal(wrapped, _run(model, "ar")), "lossless on the wrapped model"

    # Merged and unloaded: Llama's linears again, a lean forward rebuilt over new weights.
    _fake_capture(rt)
    base = peft_model.merge_and_unload()
    merged = _run(base)
    assert base._jacobi_runtime is rt and "probe" not in rt._graphs
    assert torch.equal(merged, wrapped), "the merged model decodes as the wrapped one did"

    # A weight replaced (not written in place): other addresses, the graphs go too.
    _fake_capture(rt)
    with torch.no_grad():
        lin = base.model.layers[0].mlp.down_proj
        lin.weight = torch.nn.Parameter(lin.weight.detach().clone())
    _run(base)
    assert "probe" not in rt._graphs


@pytest.mark.parametrize("method", ["ar", "jacobi", "multiblock"])
def test_float32_norms_beside_bfloat16_linears_run_as_if_cast(method):
    """A bf16 model whose RMSNorm weights are float32 (as some checkpoints keep them; the
    model's own forward raises on it) decodes as the same model with its norms cast to bf16,
    and every method equals our AR."""
    model = _model(torch.bfloat16)
    cast = copy.deepcopy(model)
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.weight.data = mod.weight.data.float()
    assert model.model.norm.weight.dtype == torch.float32
    want = _run(cast, "ar")
    assert torch.equal(_run(model, method), want)
