"""A KV cache that drops rejected tokens by moving a length, never by copying the cache.

transformers' DynamicCache concatenates on every update (a full copy of the cache per step) and
crops by slicing. TruncatableCache keeps each layer's K/V in a preallocated buffer that grows by
doubling: `update` writes the new tokens in place and returns views, `truncate` only moves the
length, and `move` relocates the few accepted K/V entries of a winning candidate row.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class BufferedLayer(DynamicLayer):
    """A full-attention cache layer backed by a growable buffer [B, H, capacity, D]."""

    def __init__(self, capacity: int = 256) -> None:
        super().__init__()
        self._capacity = capacity
        self._len = 0
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, h, _, d = key_states.shape
        self._kbuf = key_states.new_empty(b, h, self._capacity, d)
        self._vbuf = value_states.new_empty(b, h, self._capacity, value_states.shape[-1])

    def _grow(self, need: int) -> None:
        cap = self._kbuf.shape[2]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        for name in ("_kbuf", "_vbuf"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], new_cap, old.shape[3])
            new[:, :, : self._len] = old[:, :, : self._len]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        self._grow(self._len + q)
        self._kbuf[:, :, self._len : self._len + q] = key_states
        self._vbuf[:, :, self._len : self._len + q] = value_states
        self._len += q
        self.keys = self._kbuf[:, :, : self._len]
        self.values = self._vbuf[:, :, : self._len]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._len:
            raise ValueError(f"cannot truncate a cache of {self._len} tokens to {length}")
        self._len = length
        if self._kbuf is not None:
            self.keys = self._kbuf[:, :, :length]
            self.values = self._vbuf[:, :, :length]

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:  # transformers' legacy meaning: the final length
            self.truncate(tokens_to_remove)
        else:
            self.truncate(self._len - abs(tokens_to_remove))

    def move(self, src: int, dst: int, count: int) -> None:
        """Copy entries [src, src+count) to [dst, dst+count) (src > dst; no overlap issue since
        the copy goes through a temporary when ranges overlap)."""
        if count <= 0 or src == dst:
            return
        for buf in (self._kbuf, self._vbuf):
            buf[:, :, dst : dst + count] = buf[:, :, src : src + count].clone()

    def reset(self) -> None:
        self._len = 0
        self._kbuf = self._vbuf = None
        super().reset()


class TruncatableCache(DynamicCache):
    """DynamicCache whose full-attention layers are BufferedLayers (see module docstring)."""

    def __init__(self, config, capacity: int = 256) -> None:
        super().__init__(config=config)
        for i, layer in enumerate(self.layers):
            if type(layer) is not DynamicLayer:
                raise ValueError(
                    f"layer {i} uses a {type(layer).__name__} cache (sliding window or "
                    "recurrent state); jacobi_ext's decoding supports full-attention models "
                    "(Llama, Qwen2, ...)"
                )
        self.layers = [BufferedLayer(capacity) for _ in self.layers]

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)

    def move(self, src: int, dst: int, count: int) -> None:
        for layer in self.layers:
            layer.move(src, dst, count)
