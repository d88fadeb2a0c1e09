"""The CUDA lean forward's Python side (lean.CudaLeanDecoder: torch linears over concatenated
weights, the step plan passed instead of a mask, the runtime's plan path and commit) run on a
CPU: its ops have CPU twins under the same names (rope_attention, fused_add_rms_norm,
silu_and_mul, kv_commit), so forcing the "cuda" lean backend on a CPU model runs every line
of the path a GPU runs, with the CPU kernels behind it. The GPU run itself is
test_cuda_decode_ops.py."""

import pytest
import torch

from jacobi_ext.decoding import executors, lean, prepack
from jacobi_ext.decoding.engine import generate
from jacobi_ext.decoding.runtime import StaticRuntime
from jacobi_ext.models import tiny_llama


def _model(family, seed=0):
    m = tiny_llama(
        vocab_size=101, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=1, seed=seed,
        family=family,
    )  # head dim 64, GQA 4  # fmt: skip
    if family == "qwen2":  # q/k/v biases that count
        with torch.no_grad():
            for layer in m.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 1)
    return m


@pytest.fixture
def plan_path(monkeypatch):
    """The CUDA lean forward on a CPU model."""
    monkeypatch.setattr(prepack, "lean_backend", lambda model: "cuda")


def _step_logits(model, monkeypatch, lean_env):
    monkeypatch.setenv("JACOBI_EXT_LEAN", lean_env)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (2, 11), generator=g)
    pad = torch.tensor([0, 3])
    rt = StaticRuntime(model, 2, 64, 16)
    keep = lambda logits, pos: logits.clone()  # noqa: E731
    pre = rt.prefill(ids, pad, None, rule=keep)
    with torch.inference_mode():
        q = 6
        rt.ids[:, :q] = torch.arange(q)[None] + 7
        rt.seg[:, :q] = torch.tensor([0, 0, 0, 0, 1, 1])  # a main row and a candidate row
        rt.off[:, :q] = torch.tensor([0, 1, 2, 3, 0, 1])
        step = rt.forward(q, rt.scratch + 11, rule=keep)
    return rt, pre, step


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_plan_forward_logits_match_transformers_forward(family, plan_path, monkeypatch):
    model = _model(family)
    rt, pre, step = _step_logits(model, monkeypatch, "1")
    assert isinstance(rt._lean, lean.CudaLeanDecoder) and rt._lean.executor is executors.CUDA
    assert not rt.writes_in_place()
    _, pre_hf, step_hf = _step_logits(model, monkeypatch, "0")
    torch.testing.assert_close(pre, pre_hf)  # the prefill: the model's own pieces
    torch.testing.assert_close(step, step_hf, rtol=1e-4, atol=1e-4)


def test_plan_forward_linears_are_concatenated_once(plan_path, monkeypatch):
    model = _model("llama")
    rt, _, _ = _step_logits(model, monkeypatch, "1")
    L = rt._lean.layers[0]
    a = model.model.layers[0].self_attn
    assert torch.equal(L.qkv.weight, torch.cat([a.q_proj.weight, a.k_proj.weight,
                                                a.v_proj.weight]))  # fmt: skip
    assert L.o.weight is not None and L.o.weight.data_ptr() == a.o_proj.weight.data_ptr()
    buf = L.qkv.weight.data_ptr()
    with torch.no_grad():
        a.k_proj.weight.mul_(2)  # changed in place: rewritten into the same buffer
    rt._lean.refresh()
    assert L.qkv.weight.data_ptr() == buf
    assert torch.equal(L.qkv.weight[a.q_proj.out_features :][: a.k_proj.out_features],
                       a.k_proj.weight)  # fmt: skip


def test_plan_forward_decodes_as_transformers_greedy(plan_path, monkeypatch):
    """AR, Jacobi and multiblock through the plan path give the tokens of the same methods on
    transformers' forward (fp32; a random tiny model has no near ties at these lengths)."""
    model = _model("llama", seed=4)
    ids = torch.randint(0, 101, (3, 9), generator=torch.Generator().manual_seed(2))
    runs = {
        "ar": dict(method="ar"),
        "jacobi n=8": dict(method="jacobi", block_size=8, lookup=False),
        "multiblock": dict(method="multiblock", block_size=4, num_blocks=3, pool_size=2),
    }
    monkeypatch.setenv("JACOBI_EXT_LEAN", "0")
    want = generate(model, ids, max_new_tokens=32, method="ar").tokens
    monkeypatch.setenv("JACOBI_EXT_LEAN", "1")
    for name, kw in runs.items():
        got = generate(model, ids, max_new_tokens=32, **kw).tokens
        assert isinstance(model.__dict__.get(lean._ATTR), lean.CudaLeanDecoder)
        assert torch.equal(got, want), name


def test_weight_probes_read_at_once_equal_one_by_one() -> None:
    """prepack.probes: every weight's probe in one device -> host read (the CUDA lean forward's
    refresh: a read per linear would be a synchronisation each), the same values as one by
    one; a weight rewritten through .data (no version bump) changes its probe."""
    from jacobi_ext.decoding import prepack
    from jacobi_ext.models import tiny_llama

    model = tiny_llama(dtype=torch.float32)
    ws = [p for p in model.parameters() if p.dim() == 2]
    at_once = prepack.probes(ws)
    assert at_once == {id(w): prepack._probe(w) for w in ws}
    w = ws[3]
    stamp = prepack.weight_stamp(w, at_once)
    w.data.mul_(2)
    assert not prepack.same_stamp(prepack.weight_stamp(w, prepack.probes(ws)), stamp)
    assert prepack.probes([torch.empty(4, 4, device="meta")]) != {}
