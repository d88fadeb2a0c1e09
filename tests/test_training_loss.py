"""The JF loss (one jacobi forward, only the needed logits, chunked soft CE) against a dense
reference: the same weights under SDPA with layout.dense_mask(), full logits, plain formulas."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

import jacobi_ext  # noqa: F401  (registers attn_implementation="jacobi")
from jacobi_ext.models import tiny_llama
from python_training import loss as jf_loss
from python_training.packing import IGNORE, pack

V, EOS, PAD = 96, 3, 3


def synthetic_blocks(rng: random.Random, T: int, n: int, eos_last: bool) -> list:
    blocks = []
    for j in range(T):
        fixed = [rng.randrange(4, V) for _ in range(n)]
        if eos_last and j == T - 1:
            fixed = fixed[: n // 2] + [EOS]
        states = []
        for d in range(1, n):  # states converging left to right, with some repeats
            if rng.random() < 0.6:
                states.append(fixed[:d] + [rng.randrange(4, V) for _ in range(n - d)])
        states.append(fixed)
        blocks.append(states)
    return blocks


def dense_reference(model, ex, ar_weight, temperature):
    S = ex.input_ids.numel()
    mask = ex.layout.dense_mask()[None, None]
    logits = model(
        input_ids=ex.input_ids[None], position_ids=ex.position_ids[None], attention_mask=mask
    ).logits[0]
    assert logits.shape[0] == S
    sel = ex.ar_labels != IGNORE
    ar = F.cross_entropy(logits[sel], ex.ar_labels[sel])
    terms = []
    for a, b in zip(ex.cons_noisy.tolist(), ex.cons_clean.tolist(), strict=True):
        p = F.softmax(logits[b].detach() / temperature, -1)
        terms.append(-(p * F.log_softmax(logits[a] / temperature, -1)).sum())
    cons = torch.stack(terms).mean() / ex.num_blocks
    return ar_weight * ar + cons, ar, cons


@pytest.mark.parametrize("variant,temperature", [("noisy_context", 1.0), ("clean_context", 2.0)])
def test_loss_matches_dense_reference_values_and_grads(variant, temperature, monkeypatch):
    ours = tiny_llama(vocab_size=V, eos_token_id=EOS, attn_implementation="jacobi", seed=1)
    ref = copy.deepcopy(ours)
    ref.config._attn_implementation = "sdpa"
    ref.set_attn_implementation("sdpa")
    rng = random.Random(0)
    blocks = synthetic_blocks(rng, T=4, n=8, eos_last=True)
    ex = pack([rng.randrange(4, V) for _ in range(11)], blocks, 8, [EOS], PAD, window=4,
              variant=variant)  # fmt: skip
    assert ex.cons_noisy.numel() > 5
    monkeypatch.setattr(jf_loss, "CHUNK_ROWS", 4)  # several chunks: the chunking is exercised
    parts = jf_loss.example_loss(ours, ex, ar_weight=10.0, temperature=temperature)
    parts.total.backward()
    total, ar, cons = dense_reference(ref, ex, 10.0, temperature)
    total.backward()
    assert parts.ar == pytest.approx(float(ar.detach()), rel=1e-4)
    assert parts.consistency == pytest.approx(float(cons.detach()), rel=1e-4)
    torch.testing.assert_close(parts.total.detach(), total.detach(), rtol=1e-4, atol=1e-5)
    g = {n: p.grad for n, p in ours.named_parameters()}
    rg = {n: p.grad for n, p in ref.named_parameters()}
    for name in g:
        torch.testing.assert_close(g[name], rg[name], rtol=1e-3, atol=1e-6, msg=name)


def test_clean_logits_are_detached():
    # The soft CE's gradient flows only through the noisy side, and the row bookkeeping points
    # the two sides at the packed offsets of each pair.
    rng = random.Random(3)
    ex = pack([5, 6, 7], synthetic_blocks(rng, 2, 4, False), 4, [EOS], PAD, window=2)
    noisy = torch.randn(3, V, requires_grad=True)
    clean = torch.randn(3, V, requires_grad=True)
    jf_loss.soft_cross_entropy(noisy, clean.detach(), 1.0, chunk=2).backward()
    assert clean.grad is None and noisy.grad is not None
    keep, ar_rows, nr, cr = jf_loss.logit_rows(ex)
    assert torch.equal(keep[nr], ex.cons_noisy) and torch.equal(keep[cr], ex.cons_clean)
    # Noisy positions before f_j are never projected onto the vocabulary.
    assert keep.numel() < ex.input_ids.numel()


def _lora(model, seed):
    """``model`` with a rank-4 LoRA adapter drawn from ``seed``, B included (peft starts it at
    0, where the KL would be 0 and say nothing)."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return pm


@pytest.mark.parametrize("variant", ["noisy_context", "clean_context", "windowed"])
def test_clean_stream_is_what_clean_rows_see(variant):
    # The KL's base forward runs the clean stream alone as a plain causal sequence: in every
    # variant a clean row (and a prompt row) sees exactly the earlier prompt and clean tokens.
    rng = random.Random(5)
    ex = pack([5, 6, 7, 8, 9], synthetic_blocks(rng, 4, 4, False), 4, [EOS], PAD, window=2,
              variant=variant, mask_window=2 if variant == "windowed" else None)  # fmt: skip
    clean, layout = jf_loss.clean_stream(ex)
    assert layout.num_blocks == 0 and layout.seq_len == 5 + 4 * 4
    mask = ex.layout.dense_mask()
    for k, q in enumerate(clean.tolist()):
        assert mask[q].nonzero().flatten().tolist() == clean[: k + 1].tolist()
    assert torch.equal(ex.position_ids[clean], torch.arange(clean.numel()))


@pytest.mark.parametrize("variant", ["noisy_context", "clean_context"])
def test_kl_to_base_matches_dense_reference_values_and_grads(variant):
    # The KL term: a gradient-free forward with the adapter off gives the base's distribution
    # at the AR positions; KL(base || model) averaged over them, against a dense float64
    # reference built from a second copy of the same weights over the whole packed sequence.
    base = tiny_llama(vocab_size=V, eos_token_id=EOS, attn_implementation="jacobi", seed=2)
    ref_base = copy.deepcopy(base)
    ref_base.config._attn_implementation = "sdpa"
    ref_base.set_attn_implementation("sdpa")
    ours, ref = _lora(base, 0), _lora(ref_base, 0)
    rng = random.Random(1)
    ex = pack([rng.randrange(4, V) for _ in range(9)], synthetic_blocks(rng, 3, 8, True), 8,
              [EOS], PAD, window=4, variant=variant, ar_prompt=False)  # fmt: skip
    lam, mu = 2.0, 3.0
    parts = jf_loss.example_loss(ours, ex, ar_weight=lam, kl_weight=mu)
    parts.total.backward()

    mask = ex.layout.dense_mask()[None, None]
    kw = dict(input_ids=ex.input_ids[None], position_ids=ex.position_ids[None],
              attention_mask=mask)  # fmt: skip
    logits = ref(**kw).logits[0]
    with torch.no_grad(), ref.disable_adapter():
        base_logits = ref(**kw).logits[0]
    sel = ex.ar_labels != IGNORE
    logp = F.log_softmax(base_logits[sel].double(), -1)
    logq = F.log_softmax(logits[sel].double(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    assert float(kl.detach()) > 1e-3  # the adapter moved the model: the check has something to see
    _, ar, cons = dense_reference(ref, ex, lam, 1.0)
    (lam * ar + cons + mu * kl).backward()
    assert parts.kl == pytest.approx(float(kl.detach()), rel=1e-4)
    g = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    rg = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert g and set(g) == set(rg)
    for name in g:
        torch.testing.assert_close(g[name], rg[name].float(), rtol=1e-3, atol=1e-6, msg=name)
    # The base weights stay frozen and the adapter is back on after the loss.
    assert all(p.grad is None for n, p in ours.named_parameters() if "lora_" not in n)
    with torch.no_grad():
        assert not torch.allclose(ours(**kw).logits, base_logits)


def test_kl_to_base_needs_a_lora_model():
    model = tiny_llama(vocab_size=V, eos_token_id=EOS, attn_implementation="jacobi", seed=1)
    rng = random.Random(0)
    ex = pack([5, 6, 7], synthetic_blocks(rng, 2, 4, False), 4, [EOS], PAD, window=2)
    with pytest.raises(ValueError, match="--lora-rank"):
        jf_loss.example_loss(model, ex, kl_weight=1.0)
    # Without the term, a plain model is fine and nothing is reported for it.
    assert jf_loss.example_loss(model, ex).kl == 0.0
