"""An adapter model is loaded for the device asked for (an H200 run's fp32 rows with the shipped
adapter ran on the CPU: the base kept its GGUF codes, which only the CPU runs, and never moved)."""

from __future__ import annotations

import pytest
import torch

import jacobi_ext.models as models


class _Loaded(Exception):
    pass


@pytest.mark.parametrize(
    "dtype,device,dequantize",
    [
        (torch.float32, "cuda", True),  # a GPU: the base is dequantized, then moved there
        (torch.float32, "meta", True),
        (torch.bfloat16, "cuda", True),
        (torch.float32, "cpu", None),  # the CPU: its codes, as load_model decides there
    ],
)
def test_the_base_is_loaded_for_the_device_asked_for(monkeypatch, dtype, device, dequantize):
    from jacobi_ext.models.quantized import kernel_types

    if device == "cpu" and dtype == torch.float32 and not kernel_types():
        pytest.skip("this build has no GGUF CPU kernel")
    seen = {}

    def load(base, **kw):
        seen.update(kw, base=base)
        raise _Loaded

    monkeypatch.setattr(models, "load_model", load)
    with pytest.raises(_Loaded):
        models._load_with_adapter(
            models.ADAPTERS[models.DISTILLED_MODEL], dtype, device, "sdpa", False
        )
    assert seen["device"] == "cpu" and seen["dequantize"] is dequantize


def test_codes_on_a_gpu_refused_clearly(monkeypatch) -> None:
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("not reached"))
    with pytest.raises(ValueError, match="dequantize=False"):
        models._load_with_adapter(
            models.ADAPTERS[models.DISTILLED_MODEL], torch.float32, "cuda", "sdpa", False, False
        )
