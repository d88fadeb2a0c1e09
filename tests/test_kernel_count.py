"""The CUDA decode step's kernel count, on a CPU (jacobi_ext/tools/kernel_count.py,
`jacobi-forcing tune --kernels`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jacobi_ext.apps.cli import main
from jacobi_ext.tools import kernel_count as kc


class _Known(nn.Module):
    """Kernels by hand: addmm (linear with a bias; its transpose is a view) 1, the transpose and
    the view 0, contiguous of a transposed tensor (a copy) 1, relu 1, mul 1, zeros (an
    allocation and a fill) 1, empty 0, reshape of a contiguous tensor 0: 5."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        y = self.lin(x).transpose(0, 1).contiguous().view(-1)
        z = torch.relu(y) * 2
        torch.empty(3, device=x.device)
        return z.reshape(3, 2), torch.zeros(2, device=x.device)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_counts_a_known_module_exactly(device) -> None:
    m = _Known().to(device)
    c, _ = kc.count(m, torch.ones(2, 4, device=device))
    assert c.total == 5, dict(c.ops)
    assert c.ops["aten.addmm"] == 1 and c.ops["aten.clone"] == 1
    assert c.ops["aten.relu"] == 1 and c.ops["aten.mul"] == 1


def test_a_custom_op_is_one_kernel() -> None:
    c, out = kc.count(torch.ops.jacobi_ext.argmax, torch.randn(2, 5))
    assert dict(c.ops) == {"jacobi_ext.argmax": 1} and out.shape == (2,)


def test_per_layer_is_the_difference_of_layer_counts() -> None:
    from jacobi_ext.models import tiny_llama

    cfg = tiny_llama(num_layers=3).config
    c = kc.count_step(cfg, "ar")
    one = kc.count_step(_layers(cfg, 1), "ar")
    assert c.layers == 3 and one.total == c.total - 2 * c.per_layer
    assert c.per_layer == int(c.per_layer) > 0


def _layers(cfg, n):
    import copy

    cfg = copy.deepcopy(cfg)
    cfg.num_hidden_layers = n
    return cfg


def test_budget_check() -> None:
    fused = kc.StepCount("ar", 1, 30, 300, 9.5, "fused", {"jacobi_ext.op": 300})
    kc.check_budget(fused)
    over = kc.StepCount("ar", 1, 30, 1795, 57.0, "transformers", {"aten.mul": 335})
    assert not kc.within_budget(over)
    with pytest.raises(AssertionError, match="1795 kernels, 57.0 a layer"):
        kc.check_budget(over)


@pytest.mark.parametrize("method", ["ar", "jacobi"])
def test_the_shipped_models_step_count(method, record_property) -> None:
    """The shipped model's shape, bf16, on the CUDA path a CUDA build runs (the fused lean
    forward): within the budget, ar and Jacobi at n = 64 (issue 63: <= 10 a layer, <= 330 a
    step; transformers' forward was 57 / 1 795 and 60 / 1 926)."""
    c = kc.count_step(method=method, n=64)
    print(f"\n{kc.report([c])}")
    record_property("kernels", dict(total=c.total, per_layer=c.per_layer, forward=c.forward))
    assert c.layers == 30 and c.forward == "CudaLeanDecoder"
    kc.check_budget(c)


@pytest.mark.parametrize("method", ["ar", "jacobi"])
def test_a_qwen3_step_count(method, record_property) -> None:
    """Qwen3-0.6B's shape (28 layers, hidden 1024, 16 / 8 heads of 128, q/k norms), bf16, on
    the CUDA path: the fused forward with one more kernel a layer for the q/k norms, <= 10 a
    layer (transformers' Qwen3 layer was ~69)."""
    c = kc.count_step(kc.qwen3_06b_config(), method=method, n=64)
    print(f"\n{kc.report([c])}")
    record_property("kernels", dict(total=c.total, per_layer=c.per_layer, forward=c.forward))
    assert c.layers == 28 and c.forward == "CudaLeanDecoder"
    assert c.ops.get("jacobi_ext.qk_rms_norm_") == 28
    assert c.per_layer <= 10, kc.report([c])


def test_the_count_sees_transformers_forward_when_the_lean_one_is_off(monkeypatch) -> None:
    """The count is of what the runtime runs: with the lean forward off, transformers' layer
    (~57 kernels) is what it counts, and the budget check says so."""
    monkeypatch.setenv("JACOBI_EXT_LEAN", "0")
    c = kc.count_step(method="ar")
    assert c.forward == "transformers" and c.per_layer > 40
    with pytest.raises(AssertionError, match="a layer; budget"):
        kc.check_budget(c)


def test_tune_kernels_command(capsys) -> None:
    assert main(["tune", "--kernels", "--model", "smollm2-135m", "--width", "16"]) == 0
    out = capsys.readouterr().out
    assert "kernels per decode step on the CUDA path" in out
    assert "jacobi n=16" in out and "\nar " in out and "per layer" in out


def test_a_prefill_chunk_count(record_property) -> None:
    """A middle chunk of the chunked prefill (64 prompt tokens, no LM head, its commit) on the
    shipped model's shape: the fused forward, within the per-layer budget, and fewer kernels than
    an ar step (no head, argmax, verify or drafts)."""
    c = kc.count_step(method="prefill", n=64)
    ar = kc.count_step(method="ar")
    print(f"\n{kc.report([c])}")
    record_property("kernels", dict(total=c.total, per_layer=c.per_layer, forward=c.forward))
    assert c.forward == "CudaLeanDecoder" and c.width == 64
    kc.check_budget(c)
    assert c.total < ar.total
