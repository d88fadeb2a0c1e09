"""Stopping criteria, stop strings, max_time and cancellation (jacobi_ext.decoding.stopping):
every method ends each row exactly where transformers' own `generate` ends it with the same
criteria, batch 1 and ragged batches, through `jacobi_ext.generate` and through transformers'
`generate` with our custom_generate. Tiny float64 Llama / Qwen2 (transformers' greedy is ours
token for token there); the shipped model under `slow`."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import tiny_chat_model
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer

import jacobi_ext
from jacobi_ext.decoding import stopping

CG = {"custom_generate": jacobi_ext.CUSTOM_GENERATE, "trust_remote_code": True}
NEW = 40
METHODS = [
    dict(method="ar"),
    dict(method="ar", lookup=True),
    dict(method="jacobi", block_size=4),
    dict(method="jacobi", block_size=7, lookup=True),
    dict(method="multiblock", block_size=4, num_blocks=2, pool_size=2),
    dict(method="multiblock", block_size=5, num_blocks=3, pool_size=4, lookup=True),
]
HF_KEYS = {"method": "jacobi_method", "block_size": "jacobi_block_size",
           "num_blocks": "jacobi_num_blocks", "pool_size": "jacobi_pool_size",
           "lookup": "jacobi_lookup"}  # fmt: skip


def _cg(kw: dict) -> dict:
    return {HF_KEYS[k]: v for k, v in kw.items()}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def chat(request):
    # EOS <|im_end|> stays set: transformers pads a stopped row only when an EOS criterion is
    # there (without one it goes on writing real tokens into a row it counts as finished).
    return tiny_chat_model(dtype=torch.float64, family=request.param, seed=3)


def _batch(tok, texts: list[str]):
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


TEXTS = ["def add(a, b):", "Write a haiku", "x = [1, 2,"]


def _hf(model, ids, mask, **kw):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kw
    )


def _ours(model, ids, mask, settings, **kw):
    res = jacobi_ext.generate(
        model, ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, **settings, **kw
    )
    return torch.cat([ids, res.tokens], dim=1), res


def _custom(model, ids, mask, settings, **kw):
    """transformers' `generate` running our decoder (custom_generate) with `settings`."""
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, **_cg(settings), **CG, **kw
    )


def _same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """transformers pads a batch's stopped rows to the longest row; so do we."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert torch.equal(ours, ref), (ours - ref).nonzero()[:4]


def _stop_text(tok, row: torch.Tensor, at: int) -> str:
    """Two characters of the answer, ending at token `at`: a stop string that fires there."""
    return tok.decode(row[at - 1 : at + 1])


@pytest.mark.parametrize("settings", METHODS, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("batch", [1, 3])
def test_stop_strings_equal_transformers(chat, settings, batch):
    model, tok = chat
    ids, mask = _batch(tok, TEXTS[:batch])
    P = ids.shape[1]
    full = _hf(model, ids, mask)
    stops = [_stop_text(tok, full[0, P:], 9), _stop_text(tok, full[-1, P:], 23)]
    ref = _hf(model, ids, mask, stop_strings=stops, tokenizer=tok)
    assert ref.shape != full.shape or not torch.equal(ref, full)  # the stop fired
    ours, _ = _ours(model, ids, mask, settings, stop_strings=stops, tokenizer=tok)
    _same(ours, ref)
    _same(_custom(model, ids, mask, settings, stop_strings=stops, tokenizer=tok), ref)


class _LastTokenIn(StoppingCriteria):
    """Per row: stop when the last token is one of `ids` (each row meets them at its own place)."""

    def __init__(self, ids):
        self.ids = torch.tensor(sorted(ids))

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.ids)


@pytest.mark.parametrize("settings", METHODS, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("batch", [1, 3])
def test_custom_criterion_stops_rows_alone(chat, settings, batch):
    model, tok = chat
    ids, mask = _batch(tok, TEXTS[:batch])
    P = ids.shape[1]
    full = _hf(model, ids, mask)
    # A token of row 0's answer at position 12 (and whatever else holds it earlier): row 0 stops
    # there, the others where they meet it, or never.
    crit = _LastTokenIn([int(full[0, P + 12])])
    ref = _hf(model, ids, mask, stopping_criteria=StoppingCriteriaList([crit]))
    ours, res = _ours(model, ids, mask, settings, stopping_criteria=[crit])
    _same(ours, ref)
    _same(_custom(model, ids, mask, settings, stopping_criteria=[crit]), ref)
    assert res.lengths[0] <= 13
    if batch > 1:
        assert max(res.lengths) > res.lengths[0]  # a row that did not stop went on


@pytest.mark.parametrize("settings", METHODS, ids=lambda s: "-".join(map(str, s.values())))
def test_eos_lists_equal_transformers(chat, settings):
    """Several EOS ids (a list, as generation configs hold them): each row ends at the first."""
    model, tok = chat
    ids, mask = _batch(tok, TEXTS)
    P = ids.shape[1]
    full = _hf(model, ids, mask)
    eos = [2, int(full[1, P + 6]), int(full[2, P + 15])]
    ref = _hf(model, ids, mask, eos_token_id=eos)
    assert not torch.equal(ref, full[:, : ref.shape[1]])  # an EOS ended a row early
    ours, _ = _ours(model, ids, mask, settings, eos_token_id=eos)
    _same(ours, ref)
    _same(_custom(model, ids, mask, settings, eos_token_id=eos), ref)


def test_plain_function_criterion_and_lists(chat):
    """A function (input_ids, scores) -> bool tensor, several criteria or-ed, and the server's
    criterion that never fires: output unchanged."""
    model, tok = chat
    ids, mask = _batch(tok, TEXTS)
    P = ids.shape[1]
    full = _hf(model, ids, mask)
    never = lambda input_ids, scores: torch.zeros(input_ids.shape[0], dtype=torch.bool)  # noqa: E731
    ours, _ = _ours(model, ids, mask, METHODS[4], stopping_criteria=[never])
    _same(ours, full)
    length = lambda input_ids, scores: input_ids.shape[1] >= P + 17  # noqa: E731  (a plain bool)
    crit = [never, length, _LastTokenIn([int(full[1, P + 5])])]
    ref = _hf(model, ids, mask, stopping_criteria=StoppingCriteriaList(crit))
    ours, _ = _ours(model, ids, mask, METHODS[5], stopping_criteria=crit)
    _same(ours, ref)


@pytest.mark.parametrize("settings", [METHODS[0], METHODS[3], METHODS[5]])
def test_max_time(chat, settings):
    model, tok = chat
    ids, mask = _batch(tok, TEXTS)
    ref = _hf(model, ids, mask, max_time=0.0)  # fires at the first token
    assert ref.shape[1] == ids.shape[1] + 1
    ours, res = _ours(model, ids, mask, settings, max_time=0.0)
    _same(ours, ref)
    ours, _ = _ours(model, ids, mask, settings, max_time=600.0)
    _same(ours, _hf(model, ids, mask))
    with pytest.raises(ValueError, match="max_time"):
        _ours(model, ids, mask, settings, max_time=-1.0)


class _CancelAfterFirstChunk(TextStreamer):
    """A client that leaves once it has seen the first generated chunk: the flag a criterion
    reads turns true between two steps, as serve's stop_if_cancelled does."""

    def __init__(self, tok):
        super().__init__(tok, skip_prompt=True)
        self.cancelled, self.chunks, self.seen = False, [], 0

    def put(self, value):
        if self.seen:
            self.chunks.append(value.tolist())
            self.cancelled = True
        self.seen += 1
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        pass


@pytest.mark.parametrize("settings", [METHODS[1], METHODS[2], METHODS[5]])
def test_cancellation_stops_within_one_step(chat, settings):
    model, tok = chat
    ids, mask = _batch(tok, TEXTS[:1])
    full = _hf(model, ids, mask)[0, ids.shape[1] :].tolist()
    streamer = _CancelAfterFirstChunk(tok)

    def cancelled(input_ids, scores):
        return torch.full((input_ids.shape[0],), streamer.cancelled, dtype=torch.bool)

    _, res = _ours(model, ids, mask, settings, stopping_criteria=[cancelled], streamer=streamer)
    got = res.tokens[0].tolist()
    first = streamer.chunks[0]
    assert got == full[: len(first) + 1]  # the first chunk, then the next step's first token
    assert sum(streamer.chunks, []) == got  # the stream holds exactly the output


def test_streamer_is_cut_at_the_stop(chat):
    model, tok = chat
    ids, mask = _batch(tok, TEXTS[:1])
    P = ids.shape[1]
    full = _hf(model, ids, mask)
    stops = [_stop_text(tok, full[0, P:], 14)]
    got: list[list[int]] = []

    class Record(TextStreamer):
        def put(self, value):
            got.append(value.tolist())

        def end(self):
            got.append(["end"])

    ours, _ = _ours(model, ids, mask, METHODS[5], stop_strings=stops, tokenizer=tok,
                    streamer=Record(tok))  # fmt: skip
    assert got[-1] == ["end"]
    assert got[0] == ids[0].tolist()  # the prompt first, as transformers
    assert sum(got[1:-1], []) == ours[0, P:].tolist()
    assert len(got) > 3  # streamed chunk by chunk


@pytest.mark.parametrize("settings", [METHODS[2], METHODS[5]])
def test_sampling_with_criteria_equals_ar_sample_cut(chat, settings):
    """Sampling: every method returns our ar sample; a criterion cuts it where it fires."""
    model, tok = chat
    ids, mask = _batch(tok, TEXTS)
    P = ids.shape[1]
    kw = dict(do_sample=True, temperature=0.9, top_k=30, seed=11)
    full, _ = _ours(model, ids, mask, dict(method="ar"), **kw)
    crit = _LastTokenIn([int(full[0, P + 8]), int(full[2, P + 20])])
    want, _ = _ours(model, ids, mask, dict(method="ar"), stopping_criteria=[crit], **kw)
    ours, _ = _ours(model, ids, mask, settings, stopping_criteria=[crit], **kw)
    _same(ours, want)
    for b in range(3):  # want is the full sample cut at each row's first firing position
        row = full[b, P:].tolist()
        cut = next((t + 1 for t, x in enumerate(row) if crit(torch.tensor([[x]]), None)), NEW)
        assert want[b, P : P + cut].tolist() == row[:cut]
        assert (want[b, P + cut :] == 0).all()


def test_errors_say_what_to_do(chat):
    model, tok = chat
    ids, mask = _batch(tok, TEXTS[:1])
    with pytest.raises(ValueError, match="tokenizer"):
        _ours(model, ids, mask, METHODS[0], stop_strings=["x"])
    with pytest.raises(ValueError, match="tokenizer"):  # transformers' own words, via generate
        model.generate(ids, attention_mask=mask, max_new_tokens=4, stop_strings=["x"], **CG)
    with pytest.raises(TypeError, match="not callable"):
        _ours(model, ids, mask, METHODS[0], stopping_criteria=["x"])
    bad = lambda input_ids, scores: torch.zeros(5, dtype=torch.bool)  # noqa: E731
    with pytest.raises(ValueError, match=r"shape \[batch\]"):
        _ours(model, ids, mask, METHODS[0], stopping_criteria=[bad])


def test_no_criterion_no_work(chat, monkeypatch):
    """Without criteria no StopCheck is made; with the server's one, one call per committed
    position, not per forward's fed token."""
    model, tok = chat
    ids, mask = _batch(tok, TEXTS[:1])
    made = []
    real = stopping.StopCheck

    class Spy(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(stopping, "StopCheck", Spy)
    _ours(model, ids, mask, METHODS[4])
    assert made == []
    never = lambda input_ids, scores: torch.zeros(input_ids.shape[0], dtype=torch.bool)  # noqa: E731
    _, res = _ours(model, ids, mask, METHODS[4], stopping_criteria=[never])
    assert len(made) == 1 and made[0].calls == res.new_tokens


# --- the shipped model --------------------------------------------------------------------


@pytest.mark.slow
def test_shipped_model_stop_strings_equal_transformers():
    """smollm2-jf on a few HumanEval prompts: stop strings and a custom criterion end every
    method's answer where transformers' generate ends it on the same model."""
    from jacobi_ext.data import humaneval_input_ids, load_humaneval
    from jacobi_ext.models import load_model

    model, tok = load_model("smollm2-jf")
    stops = ["\n\n\n", "return"]
    crit = _LastTokenIn([tok.convert_tokens_to_ids(":")])
    for prob in load_humaneval(3):
        ids = humaneval_input_ids(tok, prob)
        mask = torch.ones_like(ids)
        for kw in (dict(stop_strings=stops, tokenizer=tok), dict(stopping_criteria=[crit])):
            ref = model.generate(
                ids, attention_mask=mask, max_new_tokens=96, do_sample=False,
                pad_token_id=tok.eos_token_id, **kw,
            )  # fmt: skip
            for settings in (METHODS[0], METHODS[3], METHODS[5], dict()):
                res = jacobi_ext.generate(
                    model, ids, max_new_tokens=96, pad_token_id=tok.eos_token_id, **settings, **kw
                )
                got = res.tokens[0].tolist()
                assert got == ref[0, ids.shape[1] :].tolist(), (prob["task_id"], settings, kw)


def test_cli_generate_stop(chat, monkeypatch, capsys):
    """`jacobi-forcing generate --stop TEXT`: the printed answer ends at TEXT."""
    from jacobi_ext.apps import cli

    model, tok = chat
    monkeypatch.setattr(cli, "_load", lambda args: (model, tok))
    argv = ["generate", "--prompt", "hi", "--raw", "--method", "jacobi", "--block-size", "4",
            "--max-new-tokens", str(NEW)]  # fmt: skip
    assert cli.main(argv) == 0
    full = capsys.readouterr().out
    ids = tok("hi", return_tensors="pt").input_ids
    answer = jacobi_ext.generate(model, ids, max_new_tokens=NEW, method="ar").tokens[0]
    stop = _stop_text(tok, answer, 11)
    assert cli.main([*argv, "--stop", stop, "--max-time", "600"]) == 0
    out = capsys.readouterr().out
    text = tok.decode(answer, skip_special_tokens=True)
    cut = text[: text.index(stop) + len(stop)]
    assert cut in out and cut != text
    assert f"{len(answer)} tokens" in full and f"{len(tok(cut).input_ids)} tokens" in out
