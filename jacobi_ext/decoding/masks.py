"""Attention masks and position ids of a decoding step, built on the device from small tensors.

The static runtime (runtime.py) stores K/V in *slots* that are not positions: slot order does
not matter to attention (keys carry their RoPE position already), only which slots a query may
see. The cache of one sequence (row b of the batch) is

    slots [0, S)            scratch: the tokens fed by the current step, query i writes slot i
    slots [S, capacity)     committed: the left-padded prompt, then the generated tokens

and sequence b's committed tokens are exactly the slots in [lo[b], hi[b]). A step feeds, per
sequence, packed rows that all continue the committed prefix (the main row, candidate rows):
`seg[b, i]` is the row of query i (-1 for padding) and `off[b, i]` its offset inside that row.
Query i sees the committed slots and the earlier tokens of its own row (a tree mask), so rows
never see each other. A padding query sees only its own slot, which keeps every softmax row
non-empty (an all-masked row would give NaN, and 0 * NaN poisons the real rows through V).

Everything here is shape-static given (B, Q, width) and reads no host values, so a CUDA graph
can capture it together with the model forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class StepPlan(NamedTuple):
    """What a decoding step's attention sees, as the runtime keeps it on the device: each fed
    token's row seg [B, Q] (-1: padding) and offset off [B, Q], and each sequence's committed
    slots [lo[b], hi[b]). The CUDA executor's attention reads it as it is (jacobi/decode_step.h
    has the rule, for both devices); an executor that needs a mask takes from_plan's."""

    seg: torch.Tensor
    off: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor


class StepView(NamedTuple):
    """What one forward's attention reads and where it writes, as every executor takes it
    (executors.py): a step's plan, or for a one-pass prefill (plan None) its bool mask; the
    slots the fed tokens' K/V go to; the slots a mask covers (width); and, for a step written in
    place (runtime.writes_in_place), the first slot it writes."""

    plan: StepPlan | None
    slots: torch.Tensor
    width: int
    write_at: int | None = None
    prefill: torch.Tensor | None = None  # the one-pass prefill's mask (prefill_mask)

    def mask(self) -> torch.Tensor:
        """The bool mask [B, 1, Q, width]: from the plan (from_plan), or the prefill's."""
        if self.plan is None:
            return self.prefill
        return from_plan(self.plan, self.width, self.write_at)


def from_plan(plan: StepPlan, width: int, write_at: int | None = None) -> torch.Tensor:
    """The bool mask [B, 1, Q, width] of a step plan: the one place a mask is derived from it.
    On a CPU one native pass (cpu_step_mask, ~0.15 ms a step less than step_mask's ~15 ops),
    elsewhere step_mask. write_at: one sequence's step that writes its K/V at slots
    [write_at, write_at + Q) instead of scratch (runtime.writes_in_place; width = write_at + Q,
    write_at >= Q): the step's own columns move there."""
    seg, off, lo, hi = plan
    if seg.device.type == "cpu":
        mask = torch.ops.jacobi_ext.cpu_step_mask(seg, off, lo, hi, width)
    else:
        mask = step_mask(seg, off, lo, hi, width)
    if write_at is not None:
        Q = seg.shape[1]
        mask[..., write_at:] = mask[..., :Q]  # (the committed start lo >= scratch >= Q)
        mask[..., :Q] = False
    return mask


def step_mask(
    seg: torch.Tensor, off: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, width: int
) -> torch.Tensor:
    """Bool mask [B, 1, Q, width]: True where query i may attend slot j."""
    B, Q = seg.shape
    dev = seg.device
    slots = torch.arange(width, device=dev)
    committed = (slots[None, :] >= lo[:, None]) & (slots[None, :] < hi[:, None])  # [B, width]
    real = seg >= 0
    local = (
        (seg[:, :, None] == seg[:, None, :])
        & (off[:, None, :] <= off[:, :, None])
        & real[:, :, None]
        & real[:, None, :]
    )  # [B, Q, Q]
    eye = torch.eye(Q, dtype=torch.bool, device=dev)[None]
    local = local | (eye & ~real[:, :, None])  # padding queries see themselves only
    mask = committed[:, None, :] & real[:, :, None]  # [B, Q, width]
    mask = torch.cat([mask[:, :, :Q] | local, mask[:, :, Q:]], dim=2)
    return mask[:, None]


def step_positions(off: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """RoPE positions [B, Q]: a row's token at offset o continues the committed tokens."""
    return (hi - lo)[:, None] + off


def prefill_mask(pad: torch.Tensor, P: int, n_draft: int, scratch: int) -> torch.Tensor:
    """Bool mask [B, 1, P + n_draft, scratch + P] of the prefill: the left-padded prompt (slots
    scratch + i) causal from its first real token, then n_draft draft tokens (scratch slots
    0..n_draft-1) that see the whole prompt and the drafts before them. Padding queries see
    themselves only."""
    B = pad.shape[0]
    dev = pad.device
    width = scratch + P
    i = torch.arange(P, device=dev)
    slots = torch.arange(width, device=dev)
    real_q = i[None, :] >= pad[:, None]  # [B, P]
    key_real = (slots[None, :] >= scratch + pad[:, None]) & (slots[None, :] >= scratch)
    prompt_q = key_real[:, None, :] & (slots[None, None, :] <= scratch + i[None, :, None])
    prompt_q = prompt_q & real_q[:, :, None]
    own = slots[None, None, :] == (scratch + i)[None, :, None]
    prompt_q = prompt_q | (own & ~real_q[:, :, None])
    if n_draft:
        k = torch.arange(n_draft, device=dev)
        draft_q = key_real[:, None, :] | (
            (slots[None, None, :] <= k[None, :, None]) & (slots[None, None, :] < n_draft)
        )
        prompt_q = torch.cat([prompt_q, draft_q.expand(B, n_draft, width)], dim=1)
    return prompt_q[:, None]


def for_backend(model, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool masks for SDPA-like backends; eager attention adds its mask, so give it 0 / -inf."""
    if getattr(model.config, "_attn_implementation", "sdpa") == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(dtype).min
        )
    return mask
