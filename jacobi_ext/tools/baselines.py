"""transformers' own `generate`, greedy or sampling: the baseline every speed figure is compared
against."""

from __future__ import annotations

import time

import torch


def hf_sample(model, ids: torch.Tensor, max_new_tokens: int, seed: int = 0, **sampling):
    """Sampling `model.generate(do_sample=True, **sampling)` (temperature, top_k, top_p, min_p)
    on one prompt, after `torch.manual_seed(seed)`; returns what `hf_greedy` returns."""
    torch.manual_seed(seed)
    sampling = {k: v for k, v in sampling.items() if v is not None}
    return hf_greedy(model, ids, max_new_tokens, do_sample=True, **sampling)


def hf_greedy(model, ids: torch.Tensor, max_new_tokens: int, **generate_kwargs):
    """Greedy `model.generate` on one prompt ([1, P]); returns (new tokens cut after the first
    EOS, wall seconds). An all-ones attention mask is passed so that padding is never inferred
    from token values; extra kwargs (e.g. prompt_lookup_num_tokens, or do_sample=True and its
    filters: hf_sample) go to `generate`."""
    generate_kwargs.setdefault("do_sample", False)
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    t0 = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        pad_token_id=(eos if isinstance(eos, int) else (eos[0] if eos else 0)),
        **generate_kwargs,
    )
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)
    dt = time.perf_counter() - t0
    toks = out[0, ids.shape[1] :].tolist()
    stop = {eos} if isinstance(eos, int) else set(eos or [])
    for i, t in enumerate(toks):
        if t in stop:
            return toks[: i + 1], dt
    return toks, dt
