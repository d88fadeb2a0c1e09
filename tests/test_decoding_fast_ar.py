"""One AR sequence on a CPU takes the step from lists (step.BatchStep.ar_row,
runtime.StaticRuntime.ar_forward) instead of the batch step's fixed-shape tensors: the same
forward (mask, positions, slots, ops), the same acceptance (ar_accept's rule) and the same
commit. Checked here: every token, every forward's accepted count and the forward count equal
the batch step's, with lookup drafts, EOS in the stream and max_new cuts, on an fp32 model and on
GGUF codes (whose exact head is the greedy one); and which steps take it (AR methods, one greedy
sequence on the lean CPU forward) and which do not."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from jacobi_ext import generate
from jacobi_ext.decoding import loop, step
from jacobi_ext.models import tiny_llama

sys.path.insert(0, str(Path(__file__).parent))
from gguf_fixtures import Q4_1_LAYERS, tiny_config, write_tiny_model  # noqa: E402

VOCAB = 96


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from jacobi_ext.models.quantized import build_on_codes

    cfg = tiny_config()
    # the default model's types (Q4_1 layers, a Q8_0 head): its layers one LeanLayers call
    tiny = tmp_path_factory.mktemp("fast_ar") / "tiny.gguf"
    path = write_tiny_model(tiny, cfg, head_type=Q.Q8_0, layer_types=Q4_1_LAYERS)
    return {
        "fp32": tiny_llama(vocab_size=VOCAB, seed=1),  # head size 16: inputs made in Python
        "fp32-d32": tiny_llama(vocab_size=VOCAB, hidden_size=128, seed=2),  # made natively
        "gguf": build_on_codes(cfg, path),
    }


def _decode(model, ids, max_new, eos, lookup_cost, fast: bool, monkeypatch):
    """loop.decode with the list step allowed or not; returns (result, stats, list steps)."""
    calls = []
    real_fast, real_row = step.BatchStep.ar_fast, step.BatchStep.ar_row
    monkeypatch.setattr(step.BatchStep, "ar_fast", lambda s: fast and real_fast(s))
    monkeypatch.setattr(
        step.BatchStep, "ar_row", lambda s, pl, hi: calls.append(pl.q) or real_row(s, pl, hi)
    )
    cfg = loop.DecodeConfig(
        max_new=max_new, eos=eos, block_size=1, num_blocks=1, pool_size=0, activation_ratio=0.85,
        lookup_cost=lookup_cost,
    )  # fmt: skip
    (res,), stats = loop.decode(model, ids, cfg, torch.Generator().manual_seed(0))
    return res, stats, calls


@pytest.mark.parametrize("kind", ["fp32", "fp32-d32", "gguf"])
@pytest.mark.parametrize("case", range(8))
def test_list_step_is_the_batch_step(models, kind, case, monkeypatch):
    rng = random.Random(case)
    model = models[kind]
    vocab = model.config.vocab_size
    unit = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
    P = rng.randint(1, 24)
    prompt = (unit * 30)[:P] if case % 2 else [rng.randrange(vocab) for _ in range(P)]
    max_new = rng.randint(1, 80)
    lookup = rng.choice([None, lambda q: 1.0, lambda q: 1.0 + 0.2 * q])
    # an EOS the decoding meets: a token greedy produces somewhere in its output
    free = generate(model, torch.tensor([prompt]), max_new, method="ar").tokens[0].tolist()
    eos = {free[rng.randrange(len(free))]} if case % 3 == 0 else set()
    fast = _decode(model, [prompt], max_new, eos, lookup, True, monkeypatch)
    slow = _decode(model, [prompt], max_new, eos, lookup, False, monkeypatch)
    assert fast[0].tokens == slow[0].tokens
    assert fast[0].accepted == slow[0].accepted
    assert fast[1].forwards == slow[1].forwards == len(fast[2])  # every step took the lists
    assert slow[2] == []


@pytest.mark.parametrize("kind", ["fp32", "gguf"])
def test_lookup_drafts_through_the_list_step(models, kind, monkeypatch):
    """A tiny random model falls into loops: free drafts are fed and accepted there."""
    prompt = [[7, 3, 7, 3, 7, 3]]
    fast = _decode(models[kind], prompt, 80, set(), lambda q: 1.0, True, monkeypatch)
    slow = _decode(models[kind], prompt, 80, set(), lambda q: 1.0, False, monkeypatch)
    assert fast[0].tokens == slow[0].tokens and fast[0].accepted == slow[0].accepted
    assert max(fast[2]) > 1 and max(fast[0].accepted) > 1


@pytest.mark.parametrize("kind", ["fp32", "fp32-d32", "gguf"])
def test_the_inputs_are_made_natively(models, kind, monkeypatch):
    """Where the layers run as one LeanLayers call, ar_step makes the step's inputs there too
    (embedding, rotary rows, first norm, mask, slots): the same tokens as the batch step's
    Python-made inputs (test_list_step_is_the_batch_step compares every step)."""
    from jacobi_ext.decoding import lean

    calls = []
    real = lean.LeanDecoder.ar_step
    monkeypatch.setattr(lean.LeanDecoder, "ar_step", lambda s, *a: calls.append(1) or real(s, *a))
    ids = torch.tensor([[5, 9, 2, 7, 1]])
    fast = _decode(models[kind], ids.tolist(), 30, set(), None, True, monkeypatch)
    slow = _decode(models[kind], ids.tolist(), 30, set(), None, False, monkeypatch)
    assert fast[0].tokens == slow[0].tokens
    # (rotary tables need head sizes of whole 32-lane vectors: lean._static_rope)
    assert len(calls) == (0 if kind == "fp32" else fast[1].forwards) and fast[1].forwards > 0


def test_which_steps_take_it(models, monkeypatch):
    model = models["gguf"]
    ids = torch.randint(
        0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2)
    )
    rows = []
    real = step.BatchStep.ar_row
    monkeypatch.setattr(
        step.BatchStep, "ar_row", lambda s, pl, hi: rows.append(1) or real(s, pl, hi)
    )
    generate(model, ids, 20, method="ar")
    assert len(rows) > 0
    for kw in (
        dict(method="jacobi", block_size=4),  # parallel steps
        dict(method="ar", do_sample=True, temperature=0.8, seed=1),  # a sampling rule
    ):
        rows.clear()
        generate(model, ids, 20, **kw)
        assert rows == [], kw
    rows.clear()
    generate(model, torch.cat([ids, ids]), 20, method="ar")  # a batch of two
    assert rows == []
