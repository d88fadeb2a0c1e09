"""Building a batch for `generate`: prompts of different lengths, left-padded, with their mask."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_pad(
    prompts: Sequence[torch.Tensor | Sequence[int]], pad: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)`, both [B, P] long, for `generate(model, input_ids,
    attention_mask=...)`: each prompt (1-D token ids, a tensor or a list) right-aligned, `pad`
    before it, the mask 1 on tokens and 0 on padding. On the first tensor prompt's device (CPU for
    lists). Left padding is what a batch needs: every prompt's next token is at the same column."""
    if len(prompts) == 0:
        raise ValueError("left_pad needs at least one prompt")
    rows = [
        p if isinstance(p, torch.Tensor) else torch.tensor(list(p), dtype=torch.long)
        for p in prompts
    ]
    for j, r in enumerate(rows):
        if r.dim() != 1 or r.numel() == 0:
            raise ValueError(
                f"prompt {j} has shape {tuple(r.shape)}: left_pad takes non-empty 1-D token ids "
                "(pass ids[0] for a [1, L] tensor)"
            )
    device = next((p.device for p in prompts if isinstance(p, torch.Tensor)), torch.device("cpu"))
    P = max(int(r.shape[0]) for r in rows)
    ids = torch.full((len(rows), P), int(pad), dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), P), dtype=torch.long, device=device)
    for j, r in enumerate(rows):
        ids[j, P - r.shape[0] :] = r.to(device=device, dtype=torch.long)
        mask[j, P - r.shape[0] :] = 1
    return ids, mask
