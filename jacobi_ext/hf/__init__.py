"""transformers integration: ``attn_implementation="jacobi"``.

Any transformers model that dispatches attention through ``AttentionInterface`` (Llama, Qwen2,
SmolLM2, ...) can run a packed Jacobi Forcing training forward on our kernel::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="jacobi")
    layout = JacobiLayout(prompt_len=P, block_size=n, num_blocks=T)
    with jacobi_layout(layout):
        out = model(input_ids, position_ids=layout.position_ids()[None])

Inside ``jacobi_layout(...)`` every attention layer runs :func:`jacobi_attention` over the whole
packed sequence and transformers builds no mask at all (the layout is the mask). Outside it the
model is an ordinary causal LM: attention and masks are exactly transformers' SDPA ones, so
``generate`` and KV-cache decoding work unchanged. ``model(..., jacobi_layout=layout)`` (a
keyword that transformers passes through to the attention function) works too, but then
transformers still builds its own dense mask, which is ignored.

Registration happens when ``transformers.modeling_utils`` is imported (or at once, if it already
is), so ``import jacobi_ext`` is enough and does not pay for importing transformers.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from ..kernels.attention import jacobi_attention
from ..kernels.layout import JacobiLayout

NAME = "jacobi"

_active: contextvars.ContextVar[JacobiLayout | None] = contextvars.ContextVar(
    "jacobi_ext_layout", default=None
)


@contextlib.contextmanager
def jacobi_layout(layout: JacobiLayout) -> Iterator[JacobiLayout]:
    """Run the ``attn_implementation="jacobi"`` layers of models called inside with ``layout``."""
    if not isinstance(layout, JacobiLayout):
        raise TypeError(f"jacobi_layout needs a JacobiLayout, got {type(layout).__name__}")
    token = _active.set(layout)
    try:
        yield layout
    finally:
        _active.reset(token)


def jacobi_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: q [B, Hq, S, D], k/v [B, Hkv, S, D] -> [B, S, Hq, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = kwargs.pop("jacobi_layout", None) or _active.get()
    if layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise NotImplementedError(
            "attn_implementation='jacobi' has no attention dropout; set attention_dropout=0"
        )
    if query.shape[2] != layout.seq_len or key.shape[2] != layout.seq_len:
        raise ValueError(
            f"a Jacobi layout covers one whole packed sequence of {layout.seq_len} tokens, but "
            f"this attention call has {query.shape[2]} queries and {key.shape[2]} keys "
            "(a KV cache?); "
            "run the packed training forward without past_key_values, or leave jacobi_layout()"
        )
    # Under autocast, the projections come out in the low dtype but RoPE promotes q and k back to
    # float32; SDPA is on autocast's low-precision list and casts for itself, our op does not.
    dev = query.device.type
    if torch.is_autocast_enabled(dev):
        low = torch.get_autocast_dtype(dev)
        query, key, value = query.to(low), key.to(low), value.to(low)
    out = jacobi_attention(query, key, value, layout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def jacobi_mask(*args, **kwargs):
    """Masks for ``attn_implementation="jacobi"``: none under a layout, else SDPA's."""
    from transformers.masking_utils import sdpa_mask

    if _active.get() is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register ``"jacobi"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(NAME, jacobi_attention_forward)
    AttentionMaskInterface.register(NAME, jacobi_mask)
