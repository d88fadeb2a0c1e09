"""`model.generate(..., custom_generate=jacobi_ext.CUSTOM_GENERATE, trust_remote_code=True)`:
our decoding behind transformers' API. Tiny float64 Llama / Qwen2 from a config,
CPU; the loaded custom generate function is transformers' copy of custom_generate/generate.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_fixtures import tiny_chat_model
from transformers import GenerationConfig, TextStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

import jacobi_ext
from jacobi_ext.hf.custom_generate import JACOBI_KEYS
from jacobi_ext.models import tiny_llama

CG = {"custom_generate": jacobi_ext.CUSTOM_GENERATE, "trust_remote_code": True}
FAMILIES = ["llama", "qwen2"]


def _hf_greedy(model, ids, **kw):
    return model.generate(ids, do_sample=False, **kw)


def test_custom_generate_folder_is_shipped():
    folder = os.path.join(jacobi_ext.CUSTOM_GENERATE, "custom_generate")
    assert isinstance(jacobi_ext.CUSTOM_GENERATE, str)
    assert os.path.isfile(os.path.join(folder, "generate.py"))
    reqs = open(os.path.join(folder, "requirements.txt")).read()
    assert "jacobi_ext" in reqs


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "settings",
    [
        {"jacobi_method": "multiblock", "jacobi_block_size": 4},
        {"method": "jacobi", "block_size": 5},
        {"jacobi_method": "ar"},
    ],
)
def test_greedy_equals_transformers(family, settings):
    model = tiny_llama(dtype=torch.float64, family=family)
    ids = torch.randint(0, 96, (1, 9))
    ref = _hf_greedy(model, ids, max_new_tokens=24)
    out = model.generate(ids, max_new_tokens=24, **CG, **settings)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.long
    assert torch.equal(out, ref)
    # input_ids= as a keyword, and the result as a GenerateDecoderOnlyOutput
    res = model.generate(
        input_ids=ids, max_new_tokens=24, return_dict_in_generate=True, **CG, **settings
    )
    assert isinstance(res, GenerateDecoderOnlyOutput)
    assert torch.equal(res.sequences, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_equals_our_ar_sample(family):
    model = tiny_llama(dtype=torch.float64, family=family)
    ids = torch.randint(0, 96, (1, 6))
    kw = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02)
    ours = jacobi_ext.generate(model, ids, max_new_tokens=20, method="ar", seed=7, **kw)
    out = model.generate(
        ids, max_new_tokens=20, jacobi_method="multiblock", jacobi_block_size=4, seed=7, **CG, **kw
    )
    assert torch.equal(out[0, 6:], ours.tokens[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_ragged_left_padding(family):
    probe = tiny_llama(dtype=torch.float64, family=family)
    p0 = torch.randint(0, 96, (1, 8))
    # An EOS that prompt 0's greedy answer reaches early: that row stops, the others go on.
    eos = int(_hf_greedy(probe, p0, max_new_tokens=6)[0, 8 + 4])
    model = tiny_llama(dtype=torch.float64, family=family, eos_token_id=eos)
    pad = 95 if eos != 95 else 94
    prompts = [p0[0], torch.randint(0, 96, (5,)), torch.randint(0, 96, (3,))]
    P = max(len(p) for p in prompts)
    ids = torch.full((3, P), pad, dtype=torch.long)
    mask = torch.zeros((3, P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = p
        mask[i, P - len(p) :] = 1
    kw = dict(max_new_tokens=16, attention_mask=mask, pad_token_id=pad)
    ref = _hf_greedy(model, ids, **kw)
    out = model.generate(ids, jacobi_method="multiblock", jacobi_block_size=4, **CG, **kw)
    assert torch.equal(out, ref)
    assert (out[0, P:] == pad).any()  # row 0 stopped at EOS and was padded
    for i, p in enumerate(prompts):  # and each row is its prompt's answer alone
        alone = _hf_greedy(model, p[None], max_new_tokens=16, pad_token_id=pad)
        n = alone.shape[1] - len(p)
        assert torch.equal(out[i, P : P + n], alone[0, len(p) :])


class _Collect(TextStreamer):
    def __init__(self, tok):
        super().__init__(tok, skip_prompt=True)
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text


def test_streamer_receives_the_same_text():
    model, tok = tiny_chat_model(dtype=torch.float64)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "Say hello"}], add_generation_prompt=True,
        return_tensors="pt", return_dict=True,
    )  # fmt: skip
    theirs, ours = _Collect(tok), _Collect(tok)
    ref = model.generate(**enc, max_new_tokens=30, do_sample=False, streamer=theirs)
    out = model.generate(**enc, max_new_tokens=30, streamer=ours, jacobi_block_size=4, **CG)
    assert torch.equal(out, ref)
    assert ours.text == theirs.text and len(ours.text) > 0


def test_settings_from_generation_config(tmp_path, monkeypatch):
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("JACOBI_EXT_GENERATE_LOG", str(log))
    model = tiny_llama(dtype=torch.float64)
    ids = torch.randint(0, 96, (1, 5))
    gc = GenerationConfig(max_new_tokens=12, jacobi_method="jacobi", jacobi_block_size=6)
    out = model.generate(ids, generation_config=gc, **CG)
    assert torch.equal(out, _hf_greedy(model, ids, max_new_tokens=12))
    # a keyword wins over the config's key
    model.generate(ids, generation_config=gc, jacobi_method="ar", **CG)
    # a passed config without our keys falls back to the model's (as transformers serve passes
    # a request's config)
    model.generation_config.jacobi_method = "jacobi"
    model.generation_config.jacobi_block_size = 3
    model.generate(ids, generation_config=GenerationConfig(max_new_tokens=7), **CG)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["method"] for c in calls] == ["jacobi", "ar", "jacobi"]
    assert calls[0]["block_size"] == 6 and calls[0]["new_tokens"] == 12
    assert calls[2]["block_size"] == 3 and calls[2]["new_tokens"] == 7


def test_max_length_and_context():
    model = tiny_llama(dtype=torch.float64)
    ids = torch.randint(0, 96, (1, 5))
    out = model.generate(ids, max_length=15, jacobi_method="ar", **CG)
    assert out.shape == (1, 15)
    # past the context (1024 positions): clipped there, with a warning
    with pytest.warns(UserWarning, match="context"):
        out = model.generate(ids, max_new_tokens=1100, jacobi_method="ar", **CG)
    assert out.shape[1] <= 1024


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"num_beams": 2}, "num_beams"),
        ({"repetition_penalty": 1.3}, "repetition_penalty"),
        ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size"),
        ({"logits_processor": [lambda ids, scores: scores]}, "logits_processor"),
        ({"return_dict_in_generate": True, "output_scores": True}, "output_scores"),
    ],
)
def test_refused_arguments(kw, match):
    model = tiny_llama(dtype=torch.float64)
    ids = torch.randint(0, 96, (1, 5))
    with pytest.raises(ValueError, match=match):
        model.generate(ids, max_new_tokens=4, **CG, **kw)


def test_unknown_keyword_and_conflicts():
    model = tiny_llama(dtype=torch.float64)
    ids = torch.randint(0, 96, (1, 5))
    with pytest.raises(TypeError, match="jacobi_metod"):
        model.generate(ids, max_new_tokens=4, jacobi_metod="ar", **CG)
    with pytest.raises(ValueError, match="disagree"):
        model.generate(ids, max_new_tokens=4, method="ar", jacobi_method="jacobi", **CG)
    with pytest.raises(ValueError, match="block_size"):  # the engine's own check
        model.generate(ids, max_new_tokens=4, jacobi_method="jacobi", block_size=1, **CG)


def test_direct_call_binds_like_transformers():
    """The function itself: model first (positionally or model=), then transformers' order."""
    from jacobi_ext.hf.custom_generate import generate

    model = tiny_llama(dtype=torch.float64)
    ids = torch.randint(0, 96, (1, 5))
    ref = _hf_greedy(model, ids, max_new_tokens=8)
    gc = GenerationConfig(max_new_tokens=8)
    assert torch.equal(generate(model, ids, gc, jacobi_method="ar"), ref)
    assert torch.equal(generate(ids, model=model, max_new_tokens=8, method="ar"), ref)
    with pytest.raises(ValueError, match="once"):
        generate(model, ids, input_ids=ids, max_new_tokens=8)
    assert set(JACOBI_KEYS) >= {"jacobi_method", "jacobi_block_size", "jacobi_lookup"}
