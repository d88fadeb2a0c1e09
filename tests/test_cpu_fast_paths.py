"""The CPU fast paths of the runtime: linears from packed weights (jacobi_ext/decoding/prepack.py):
which backend runs (our kernel, oneDNN's packed bf16 op, F.linear) and its switches; oneDNN's,
bitwise equal to F.linear per shape and over whole decodes; the user's model untouched outside
our steps, copies remade when a weight changes, a no-op where it does not apply; and the CPU
targets (max instead of argmax), ties included. (Our kernel's own checks: test_cpu_linear.py;
decoding through it: test_lean_forward.py.)"""

import pytest
import torch
from torch import nn

from jacobi_ext.decoding import prepack
from jacobi_ext.decoding.engine import generate
from jacobi_ext.models import tiny_llama

needs_packing = pytest.mark.skipif(
    not prepack.available(), reason="oneDNN bf16 packing needs a CPU with AVX512-BF16 / AMX"
)


@pytest.fixture
def onednn(monkeypatch):
    """The oneDNN backend, forced (by default bf16 runs on our kernel where there is no AMX)."""
    monkeypatch.setenv("JACOBI_EXT_CPU_LINEAR", "onednn")


def _forward_overridden(model) -> bool:
    return any("forward" in m.__dict__ for m in model.modules() if type(m) is nn.Linear)


@needs_packing
@pytest.mark.parametrize("seed", range(6))
def test_packed_linear_is_bitwise_f_linear(seed, onednn):
    g = torch.Generator().manual_seed(seed)
    out_f, in_f = (int(v) for v in torch.randint(1, 700, (2,), generator=g))
    lin = nn.Linear(in_f, out_f, bias=bool(seed % 2)).to(torch.bfloat16)
    model = nn.Sequential(lin)
    for shape in [(1, in_f), (3, 1, in_f), (2, 17, in_f), (1, 64, in_f)]:
        x = torch.randn(*shape, generator=g).to(torch.bfloat16)
        with torch.inference_mode():
            want = nn.functional.linear(x, lin.weight, lin.bias)
            with prepack.packed(model):
                assert "forward" in lin.__dict__  # the packed path is what ran
                got = model(x)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), f"{(out_f, in_f)} {shape}"
    assert not _forward_overridden(model)


@needs_packing
def test_nested_blocks_restore_once(onednn):
    lin = nn.Linear(8, 8).to(torch.bfloat16)
    model = nn.Sequential(lin)
    with prepack.packed(model):
        with prepack.packed(model):
            assert "forward" in lin.__dict__
        assert "forward" in lin.__dict__  # the outer block still packs
    assert not _forward_overridden(model)


@needs_packing
def test_packed_copy_follows_weight_changes(onednn):
    lin = nn.Linear(32, 48).to(torch.bfloat16)
    model = nn.Sequential(lin)
    x = torch.randn(4, 32).to(torch.bfloat16)
    with torch.inference_mode(), prepack.packed(model):
        model(x)
    with torch.no_grad():
        lin.weight.mul_(-2.0)  # in place: same tensor, new version
    with torch.inference_mode(), prepack.packed(model):
        got = model(x)
    assert torch.equal(got, nn.functional.linear(x, lin.weight, lin.bias))
    lin.weight = nn.Parameter(torch.randn(48, 32).to(torch.bfloat16))  # a new tensor
    with torch.inference_mode(), prepack.packed(model):
        got = model(x)
    assert torch.equal(got, nn.functional.linear(x, lin.weight, lin.bias))


@needs_packing
def test_autograd_falls_back_to_f_linear(onednn):
    lin = nn.Linear(16, 8).to(torch.bfloat16)
    x = torch.randn(2, 16).to(torch.bfloat16).requires_grad_()
    with prepack.packed(nn.Sequential(lin)):
        y = lin(x)
    y.float().sum().backward()  # the packed op has no backward: this must be F.linear's
    assert x.grad is not None


@needs_packing
@pytest.mark.parametrize("method", ["ar", "jacobi", "multiblock"])
def test_decoding_is_unchanged_by_onednn_packing(method, monkeypatch, onednn):
    """Whole decodes in bf16: the same tokens and forwards with oneDNN packing on and off."""
    model = tiny_llama(vocab_size=128, hidden_size=64, num_layers=2, seed=3).to(torch.bfloat16)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    runs = {}
    for env in ("1", "0"):
        monkeypatch.setenv("JACOBI_EXT_CPU_PREPACK", env)
        r = generate(model, ids, max_new_tokens=40, method=method, block_size=8)
        runs[env] = (r.tokens.tolist(), r.forwards)
        assert not _forward_overridden(model)
    assert runs["1"] == runs["0"]
    assert prepack.wanted(model) is False  # env "0" still set


def test_backend_rule(monkeypatch):
    """Our kernel for fp32 and bf16 CPU models by default (no AMX here, or AMX with ours
    measured faster); F.linear for float64 / float16; JACOBI_EXT_CPU_LINEAR=0 brings back the
    paths from before the kernel (fp32 F.linear, bf16 oneDNN-packed)."""
    monkeypatch.setattr(prepack, "cpu_has_amx", lambda: False)
    model = tiny_llama()
    assert prepack.backend(model) == "kernel"
    assert prepack.backend(tiny_llama().to(torch.float64)) is None
    assert prepack.backend(tiny_llama().to(torch.float16)) is None
    bf16 = tiny_llama().to(torch.bfloat16)
    assert prepack.backend(bf16) == "kernel"
    monkeypatch.setenv("JACOBI_EXT_CPU_LINEAR", "0")
    assert prepack.backend(model) is None
    with prepack.packed(model):
        assert not _forward_overridden(model)
    assert prepack.backend(bf16) == ("onednn" if prepack.available() else None)
    monkeypatch.setenv("JACOBI_EXT_CPU_PREPACK", "0")
    assert prepack.backend(bf16) is None
    monkeypatch.setenv("JACOBI_EXT_CPU_LINEAR", "kernel")
    assert prepack.backend(bf16) == "kernel"
    monkeypatch.setenv("JACOBI_EXT_CPU_LINEAR", "onednn")
    assert prepack.backend(model) is None  # oneDNN's packed op is bf16 only


def test_kernel_backend_packs_every_linear_and_restores_them():
    model = tiny_llama()
    lins = [m for m in model.modules() if type(m) is nn.Linear]
    x = torch.randint(0, 96, (1, 5))
    with torch.inference_mode():
        want = model(x).logits
        with prepack.packed(model):
            assert all("forward" in m.__dict__ for m in lins)
            got = model(x).logits
    assert not _forward_overridden(model)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # another summation order


@needs_packing
def test_amx_choice_is_measured_once(monkeypatch):
    """bf16 on a CPU with AMX: both products are timed on the model's widest linear, once per
    model, and the faster is kept."""
    monkeypatch.setattr(prepack, "cpu_has_amx", lambda: True)
    calls = []
    real = prepack._PackedLinear.refresh

    def counting(self):
        calls.append(self.backend)
        return real(self)

    monkeypatch.setattr(prepack._PackedLinear, "refresh", counting)
    model = tiny_llama().to(torch.bfloat16)
    first = prepack.backend(model)
    assert first in prepack.BACKENDS
    assert sorted(calls) == ["kernel", "onednn"]  # both were timed
    assert prepack.backend(model) == first and len(calls) == 2  # not again


def test_tuner_keeps_curves_of_each_backend_apart(monkeypatch):
    """Packed linears change what a forward costs: the tuner's profile key says which it timed."""
    from jacobi_ext.decoding.tuning import model_key

    model = tiny_llama()
    keys = {}
    for env in ("1", "0", "1"):
        monkeypatch.setenv("JACOBI_EXT_CPU_LINEAR", env)
        keys.setdefault(env, set()).add(model_key(model))
    assert len(keys["1"]) == 1 and keys["1"] != keys["0"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_targets_take_the_first_of_tied_maxima(dtype):
    """The runtime's CPU targets (max(-1).indices, faster) are argmax's, ties included."""
    from jacobi_ext.decoding.runtime import targets

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = (torch.randn(2, 9, 3001, generator=g) * 3).round().to(dtype)  # many ties
        logits[0, 0, 7] = logits[0, 0, 11] = 1e3  # an exact tie at the top
        assert torch.equal(targets(logits), logits.argmax(-1))
        assert int(targets(logits)[0, 0]) == 7
