"""Stopping criteria on committed tokens: they decide where a generation ends, never which tokens
it holds, so they combine with lossless parallel decoding.

transformers' `generate` asks its stopping criteria after every token: `criteria(input_ids,
scores)` with the batch's ids so far, `[B, prompt + t]` (the prompt as passed, left padding
included; a row that already ended holds `pad_token_id` after its end), and a row ends at the
first token where its answer is True, that token kept. A parallel step commits several tokens
of a row at once, so `StopCheck.check` asks the same question once per committed position, in
order, with exactly the ids transformers would pass there, and cuts each row at its first True.
The output is then transformers' output under the same criteria, for every method.

What differs from transformers' loop, and why it does not change a token:
- `scores` is None (transformers passes None too unless `output_scores=True`; the logits of a
  position are not kept here).
- The ids are a CPU tensor: the host holds the committed tokens after each step's one copy, and
  asking a criterion on the device would add a synchronisation per position.
- A row that is behind the position asked holds `pad_token_id` there; only the rows that
  committed that position read their answer, so a criterion that answers each row from its own
  ids (EOS, stop strings, lengths) answers exactly as in transformers. One that looks across rows
  or at the clock (cancellation, `max_time`) is asked after every step, so it stops within one
  step of turning true.

With no criterion given (`stop_check` returns None) decoding does no extra work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers.generation.stopping_criteria import (
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)


class StopCheck:
    """The criteria of one `generate` call and transformers' view of the batch's ids.

    `criteria`: one callable `(input_ids [B, L] long, scores) -> bool | BoolTensor[B]` (a
    transformers `StoppingCriteria` or `StoppingCriteriaList`, or a plain function); several are
    or-ed, as transformers' `StoppingCriteriaList` does. `input_ids`: the prompt as the caller
    passed it, `[B, P]`. `pad`: what a row holds after its end. `max_new`: the most tokens a row
    can commit."""

    def __init__(self, criteria: Callable, input_ids: torch.Tensor, pad: int, max_new: int):
        B, P = input_ids.shape
        self.criteria, self.P = criteria, P
        self.pad = int(pad)
        self.ids = torch.full((B, P + max_new), self.pad, dtype=torch.long)
        self.ids[:, :P] = input_ids.detach().to("cpu", torch.long)
        self.calls = 0  # criteria calls made (one per position committed by some row)

    def _ask(self, length: int) -> list[bool]:
        """Each row's answer with the batch's first `length` ids."""
        view = self.ids[:, :length]
        answer = self.criteria(view, None)
        self.calls += 1
        B = view.shape[0]
        answer = torch.as_tensor(answer).to("cpu", torch.bool)
        if answer.dim() == 0:
            answer = answer.expand(B)
        if answer.shape != (B,):
            raise ValueError(
                f"a stopping criterion answered with shape {tuple(answer.shape)}; it must return "
                f"a bool or a BoolTensor of shape [batch] = [{B}] (transformers' StoppingCriteria)"
            )
        return answer.tolist()

    def check(self, seqs: Sequence, before: Sequence[int]) -> None:
        """After a step: each sequence `s` (with `s.b`, `s.out`, `s.accepted`, `s.done`) committed
        `s.out[before[s.b]:]`. Ask the criteria at every committed position, in order; a row whose
        answer is True at position t keeps its tokens up to t and ends there."""
        P = self.P
        spans = {}
        for s in seqs:
            lo, hi = before[s.b], len(s.out)
            if hi > lo:
                self.ids[s.b, P + lo : P + hi] = torch.tensor(s.out[lo:hi], dtype=torch.long)
                spans[s.b] = (s, lo, hi)
        if not spans:
            return
        first = min(lo for _, lo, _ in spans.values())
        last = max(hi for _, _, hi in spans.values())
        for t in range(first, last):
            asking = [b for b, (_, lo, hi) in spans.items() if lo <= t < hi]
            if not asking:
                continue
            answers = self._ask(P + t + 1)
            for b in asking:
                if answers[b]:
                    s, _, hi = spans.pop(b)
                    self._end(s, t + 1, hi)
            if not spans:
                return

    def _end(self, s, keep: int, had: int) -> None:
        """Row `s` ends after `keep` tokens: what it committed past them is dropped (from its
        output, from the ids the next rows' criteria see, from its last forward's count)."""
        dropped = had - keep
        del s.out[keep:]
        self.ids[s.b, self.P + keep : self.P + had] = self.pad
        if s.accepted and dropped:
            s.accepted[-1] -= dropped
        s.done = True


def stop_check(
    stopping_criteria,
    stop_strings,
    max_time: float | None,
    tokenizer,
    input_ids: torch.Tensor,
    pad: int,
    max_new: int,
) -> StopCheck | None:
    """The call's StopCheck, or None when nothing but EOS and the length can stop it (those the
    decoder checks itself). `stopping_criteria`: a list of criteria (or a StoppingCriteriaList,
    or one callable); `stop_strings`: a string or a list of strings, matched by transformers'
    StopStringCriteria on `tokenizer`'s vocabulary; `max_time`: seconds from now, as
    transformers' MaxTimeCriteria."""
    criteria: list = []
    if stopping_criteria is not None:
        if callable(stopping_criteria) and not isinstance(stopping_criteria, (list, tuple)):
            criteria.append(stopping_criteria)
        else:
            for c in stopping_criteria:
                if not callable(c):
                    raise TypeError(
                        f"stopping_criteria holds {type(c).__name__!r}, which is not callable: "
                        "pass transformers StoppingCriteria or functions (input_ids, scores) -> "
                        "bool tensor [batch]"
                    )
                criteria.append(c)
    if max_time is not None:
        if max_time < 0:
            raise ValueError(f"max_time must be >= 0 seconds, got {max_time}")
        criteria.append(MaxTimeCriteria(max_time=float(max_time)))
    if stop_strings:
        if tokenizer is None:
            raise ValueError(
                "stop_strings need the model's tokenizer to match strings against tokens: pass "
                "tokenizer=... (as transformers' generate asks)"
            )
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    if not criteria:
        return None
    return StopCheck(StoppingCriteriaList(criteria), input_ids, pad, max_new)
