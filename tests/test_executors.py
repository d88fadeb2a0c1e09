"""Every executor of a decoding step against transformers' own forward, on tiny Llama, Qwen2 and
Qwen3 models built from a config.

A step's executors (docs/decoding.md, "One step"):
  - reference: transformers' modules over our cache, mask and positions (JACOBI_EXT_LEAN=0);
    it runs any dtype, so here in float64;
  - lean, unfused: our layer loop and packed linears, the model's own norms and attention;
  - lean, fused: our fused CPU ops called from Python (JACOBI_EXT_NATIVE=0);
  - lean, native: the same ops in one C++ call (LeanLayers, the CPU default);
  - plan: the CUDA executor's code (the step plan instead of a mask, torch linears over
    concatenated weights), run here on the ops' CPU twins.
The kernels behind the last four take float32 / bfloat16, so they run the same weights in
float32. Transformers' plain causal forward in float64 is the reference for all of them: the
reference executor within float64 rounding, the others within float32's.

The step is a prefill of two prompts (one left-padded) with draft tokens, then one step that
feeds a main row of 4 tokens and a candidate row of 2 beside it: each row's logits are those of
transformers' forward over the prompt followed by that row alone (rows never see each other).
"""

import copy

import pytest
import torch

from jacobi_ext.decoding import lean, prepack
from jacobi_ext.decoding.runtime import StaticRuntime
from jacobi_ext.models import tiny_llama

FAMILIES = ["llama", "qwen2", "qwen3"]
EXECUTORS = {  # name: (JACOBI_EXT_LEAN, JACOBI_EXT_FUSED, JACOBI_EXT_NATIVE, the plan path)
    "reference": ("0", "1", "1", False),
    "lean-unfused": ("1", "0", "0", False),
    "lean-fused": ("1", "1", "0", False),
    "lean-native": ("1", "1", "1", False),
    "plan": ("1", "1", "1", True),
}
V, P, N = 101, 11, 3  # vocabulary, prompt length, draft tokens after the prompt
PAD = [0, 3]  # the second prompt is left-padded
MAIN, CAND = [7, 8, 9, 10], [7, 12]  # the step's rows (a candidate shares the seed)


def _model64(family: str):
    m = tiny_llama(
        vocab_size=V, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, seed=3,
        family=family,
    )  # head dim 64 (the CUDA executor's)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        if family == "qwen2":  # q/k/v biases that count
            for layer in m.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.copy_(torch.randn(p.bias.shape, generator=g))
        for layer in m.model.layers:  # norms away from ones, so that a skipped norm shows
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=g))
    return m.to(torch.float64).eval()


def _prompts():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, P), generator=g)
    drafts = torch.randint(0, V, (2, N), generator=g)
    return ids, drafts


def _run(model, executor: str, monkeypatch):
    """(prefill logits [2, P + N, V], step logits [2, 6, V]) through one executor."""
    lean_env, fused, native, plan = EXECUTORS[executor]
    monkeypatch.setenv("JACOBI_EXT_LEAN", lean_env)
    monkeypatch.setenv("JACOBI_EXT_FUSED", fused)
    monkeypatch.setenv("JACOBI_EXT_NATIVE", native)
    if plan:
        monkeypatch.setattr(prepack, "lean_backend", lambda model: "cuda")
    ids, drafts = _prompts()
    rt = StaticRuntime(model, 2, 64, 16)
    keep = lambda logits, pos: logits.clone()  # noqa: E731  (the rule sees the raw logits)
    pre = rt.prefill(ids, torch.tensor(PAD), drafts, rule=keep, all_targets=True)
    ran = rt._lean  # the executor under test is the one that ran
    assert bool(ran) == (lean_env == "1")
    if ran:
        assert isinstance(ran, lean.CudaLeanDecoder) == plan
        assert (ran.native is not None) == (native == "1" and fused == "1" and not plan)
    rows = MAIN + CAND
    q = len(rows)
    with torch.inference_mode():
        rt.ids[:, :q] = torch.tensor(rows)[None]
        rt.seg[:, :q] = torch.tensor([0] * len(MAIN) + [1] * len(CAND))[None]
        rt.off[:, :q] = torch.tensor(list(range(len(MAIN))) + list(range(len(CAND))))[None]
        step = rt.forward(q, rt.scratch + P, rule=keep)
    return pre.double(), step.double()


def _transformers(model64):
    """What each executor must give, from transformers' plain causal forward in float64 over
    each sequence's real tokens: the prefill's rows, the main row's and the candidate's."""
    ids, drafts = _prompts()
    pre, step = [], []
    with torch.no_grad():
        for b in range(2):
            prompt = ids[b, PAD[b] :].tolist()
            run = lambda toks: model64(input_ids=torch.tensor([toks])).logits[0]  # noqa: E731
            full = run(prompt + drafts[b].tolist())
            pre.append(torch.cat([torch.full((PAD[b], V), float("nan"), dtype=full.dtype), full]))
            main = run(prompt + MAIN)[-len(MAIN) :]
            cand = run(prompt + CAND)[-len(CAND) :]
            step.append(torch.cat([main, cand]))
    return torch.stack(pre), torch.stack(step)


@pytest.mark.parametrize("executor", list(EXECUTORS))
@pytest.mark.parametrize("family", FAMILIES)
def test_each_executor_is_transformers_forward(family, executor, monkeypatch):
    model64 = _model64(family)
    want_pre, want_step = _transformers(model64)
    if executor == "reference":
        model, scale = model64, 1e-12  # float64 rounding
    else:
        model, scale = copy.deepcopy(model64).float(), 2e-5  # float32 rounding
        assert lean.why_not(model) is None
    pre, step = _run(model, executor, monkeypatch)
    real = ~torch.isnan(want_pre[..., 0])  # padding queries see themselves only: not compared
    # The prefill's drafts see the prompt and the drafts before them: a causal row, as above.
    for got, want in ((pre[real], want_pre[real]), (step, want_step)):
        atol = scale * float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
        if executor != "reference":  # the bound is tight: float32 is not float64 here
            assert float((got - want).abs().max()) > 1e-12
