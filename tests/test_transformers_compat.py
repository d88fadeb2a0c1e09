"""Keeping up with transformers: our forward calls use the cache keyword the installed
transformers has (`cache` from 5.24, `past_key_values` before), and a library user sees no
deprecation warning, nor transformers' logged one, from our generate path. Run on the oldest and
the newest supported transformers (pyproject.toml), see the README."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import transformers
from packaging.version import Version

from jacobi_ext import generate
from jacobi_ext.decoding import runtime
from jacobi_ext.models import tiny_llama

RENAMED_IN = Version("5.24.0")  # transformers' models' forward takes `cache=` from here on
VOCAB = 64


@pytest.fixture(scope="module")
def models():
    return [
        tiny_llama(vocab_size=VOCAB, seed=s, dtype=torch.float64, family=fam)
        for s, fam in enumerate(("llama", "qwen2"))
    ]


def _installed_name() -> str:
    return "cache" if Version(transformers.__version__) >= RENAMED_IN else "past_key_values"


def test_cache_keyword_follows_the_installed_transformers(models) -> None:
    for model in models:
        assert runtime.cache_kwarg(model) == _installed_name()


def test_cache_keyword_is_read_from_the_forward() -> None:
    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kw): ...

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kw): ...

    class Wrapper(torch.nn.Module):  # only **kwargs: the installed transformers' name
        def forward(self, *args, **kw): ...

    assert runtime.cache_kwarg(New()) == "cache"
    assert runtime.cache_kwarg(Old()) == "past_key_values"
    assert runtime.cache_kwarg(Wrapper()) == _installed_name()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("method", ["ar", "jacobi", "multiblock"])
def test_generate_warns_nothing(models, method: str) -> None:
    # Every warning is an error here, and transformers' logged deprecations (logger.warning_once,
    # whose once-cache is cleared so that an earlier test cannot hide one) are collected too.
    ids = torch.tensor([[5, 9, 2, 7, 1, 3], [0, 0, 4, 8, 6, 2]])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    kw = {} if method == "ar" else dict(block_size=4)
    records = _Records()
    tf_logger = logging.getLogger("transformers")
    once = getattr(logging.Logger, "warning_once", None)
    if hasattr(once, "cache_clear"):
        once.cache_clear()
    tf_logger.addHandler(records)
    try:
        for model in models:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                res = generate(model, ids, 12, method=method, attention_mask=mask, **kw)
            assert res.tokens.shape[0] == 2
    finally:
        tf_logger.removeHandler(records)
    assert not [m for m in records.messages if "deprecat" in m.lower()], records.messages


@pytest.mark.parametrize("packed", [False, True])
def test_gguf_packing_note_held_unless_the_model_keeps_packed_modules(packed):
    """transformers notes "weights packed is fastest in float32" on every bf16 GGUF load, also
    when it unpacks every weight (no `kernels` package): load_model holds the note back and lets
    it through only for a model that kept packed GGUF modules. Other records pass untouched."""
    from jacobi_ext.models import _gguf_packing_note_held

    log = logging.getLogger("transformers.quantizers.quantizer_gguf")
    # A handler on the logger itself: transformers' root logger does not propagate, so with
    # some pytest versions caplog's handler (on the root logger) never sees these records.
    msgs: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msgs.append(record.getMessage())

    handler = Collect(logging.WARNING)
    log.addHandler(handler)
    try:
        with _gguf_packing_note_held() as held:
            log.warning("Loading a GGUF checkpoint with its weights packed is fastest in float32")
            log.warning("something else")
        held.release_if(packed)
    finally:
        log.removeHandler(handler)
    assert "something else" in msgs
    assert any("packed is fastest" in m for m in msgs) == packed
