"""A read-only wrapper on vLLM's model runner that keeps what Jacobi decoding needs.

vLLM's greedy rejection sampler computes the target's argmax at every verified position and
keeps only the accepted prefix plus one; a custom proposer is handed the accepted tokens only.
The Jacobi update needs the rest: the model's own predictions at the positions it did not
accept. `install()` wraps `GPUModelRunner._sample` (the CPU runner inherits it) so that each
step records, before calling the original unchanged:

- the request ids in batch order (`input_batch.req_ids`),
- the drafts verified for each request (`SpecDecodeMetadata.draft_token_ids`, split by
  `num_draft_tokens`),
- the argmax of the logits at every sampled position of each request (drafts + 1).

The argmax is taken before the original runs, since vLLM's sampler may update the logits in
place; it is a read, and every token still comes from vLLM's own verifier, so the output is the
same with or without the wrapper. The last record is where the proposer (in the same worker
process, right after the step's bookkeeping) reads it.

The names wrapped were read from vLLM 0.32.0's source. `install()` checks the version and the
signature first; on a mismatch it wraps nothing and logs one warning, and the proposer drafts
from context lookup only (still lossless).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger("jacobi_vllm")

TESTED_VLLM = ("0.32.",)  # version prefixes the wrapper was read from and tested on
SAMPLE_PARAMS = ["self", "logits", "spec_decode_metadata"]
METADATA_FIELDS = ("draft_token_ids", "num_draft_tokens")


@dataclass
class StepRecord:
    """One verified step: per request (batch order), its id, the drafts vLLM verified and the
    target's argmax at each of its drafts + 1 positions; `at`: time.perf_counter() when vLLM
    handed the step's logits to its sampler (benchmarks time steps by it)."""

    step: int
    req_ids: list[str]
    drafts: list[list[int]]
    argmax: list[list[int]]
    at: float = 0.0


class _State:
    installed: bool | None = None  # None: not tried; False: refused (reason in `why_not`)
    why_not: str | None = None
    original = None
    step = 0
    last: StepRecord | None = None
    history: deque | None = None  # every record, when recording is on (tests, benchmarks)
    broken: str | None = None  # a record failed at run time: the wrapper stopped recording


STATE = _State()


def check(runner_cls=None, version: str | None = None) -> str | None:
    """Why the wrapper does not fit this vLLM (None: it does)."""
    if version is None:
        import vllm

        version = getattr(vllm, "__version__", "?")
    if not version.startswith(TESTED_VLLM):
        return f"vLLM {version} is not a tested version ({', '.join(TESTED_VLLM)}x)"
    if runner_cls is None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as runner_cls
    fn = getattr(runner_cls, "_sample", None)
    if fn is None:
        return "GPUModelRunner has no _sample"
    params = list(inspect.signature(fn).parameters)
    if params != SAMPLE_PARAMS:
        return f"GPUModelRunner._sample{tuple(params)} is not _sample{tuple(SAMPLE_PARAMS)}"
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    fields = getattr(SpecDecodeMetadata, "__dataclass_fields__", {})
    missing = [f for f in METADATA_FIELDS if f not in fields]
    if missing:
        return f"SpecDecodeMetadata has no {', '.join(missing)}"
    return None


def install(record_history: bool = False, allow_untested: bool = False) -> bool:
    """Wrap GPUModelRunner._sample once per process. True when the wrapper is in place; False
    (with one warning, the first time) when this vLLM does not match what it was written for."""
    if record_history and STATE.history is None:
        STATE.history = deque()
    if STATE.installed is not None:
        return STATE.installed
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    why = check(GPUModelRunner)
    if why is not None and allow_untested and why.startswith("vLLM "):
        why = check(GPUModelRunner, version=TESTED_VLLM[0] + "0")
    if why is not None:
        STATE.installed, STATE.why_not = False, why
        logger.warning(
            "jacobi_vllm: %s; not wrapping it, so the proposer cannot see the target's "
            "predictions at rejected positions and drafts from context lookup only (the "
            "output is unchanged; only the speed-up is smaller)",
            why,
        )
        return False
    original = GPUModelRunner._sample

    def _sample(self, logits, spec_decode_metadata):
        if logits is not None and STATE.broken is None:
            try:
                rec = _record(self, logits, spec_decode_metadata)
            except Exception as exc:  # never break the engine: stop recording, say so once
                STATE.broken = f"{type(exc).__name__}: {exc}"
                STATE.last = None
                logger.warning(
                    "jacobi_vllm: recording a step failed (%s); drafting from context lookup "
                    "only from now on (the output is unchanged)",
                    STATE.broken,
                )
            else:
                STATE.last = rec
                if STATE.history is not None:
                    STATE.history.append(rec)
        return original(self, logits, spec_decode_metadata)

    _sample.__wrapped__ = original  # type: ignore[attr-defined]
    _sample.__jacobi_vllm__ = True  # type: ignore[attr-defined]
    GPUModelRunner._sample = _sample
    STATE.installed, STATE.original = True, original
    return True


def uninstall() -> None:
    """Put the original back (tests)."""
    if STATE.installed:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        GPUModelRunner._sample = STATE.original
    STATE.installed, STATE.why_not, STATE.original = None, None, None
    STATE.last, STATE.history, STATE.broken = None, None, None


def _record(runner, logits, meta) -> StepRecord:
    at = time.perf_counter()
    req_ids = list(runner.input_batch.req_ids)
    am = logits.argmax(dim=-1).tolist()
    if meta is None:
        counts = [0] * len(req_ids)
        flat: list[int] = []
    else:
        counts = [int(c) for c in meta.num_draft_tokens]
        flat = meta.draft_token_ids.tolist()
    if len(counts) != len(req_ids) or sum(counts) + len(counts) != len(am):
        raise ValueError(
            f"{len(req_ids)} requests, {len(counts)} draft counts, {len(am)} logits rows"
        )
    drafts, argmax, d, g = [], [], 0, 0
    for c in counts:
        drafts.append(flat[d : d + c])
        argmax.append(am[g : g + c + 1])
        d, g = d + c, g + c + 1
    STATE.step += 1
    return StepRecord(STATE.step, req_ids, drafts, argmax, at)
