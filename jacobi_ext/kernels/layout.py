"""The Jacobi Forcing sequence layout and the general block-causal table it compiles to.

A packed JF training sequence is ``[prompt P][noisy_0 n][clean_0 n] ... [noisy_{T-1}][clean_{T-1}]``
(docs/method.md §1). Which keys a query may attend (same section) is block-causal: it is
decided per (query block, key block) pair, plus causality inside the diagonal block.
:class:`BlockTable` is that general form (the struct in ``csrc/include/jacobi/block_table.h``) and
:class:`JacobiLayout` describes one JF sequence; everything else (position ids, the kernels' table,
the dense mask of the tests, the FlexAttention ``mask_mod``) is derived from it.

The visibility rule itself is stated once, in C++ (``JfLayout`` in block_table.h), and reaches
Python through ``torch.ops.jacobi_ext.jf_block_table``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import ops as _ops  # noqa: F401  (registers the fake kernels)
from ._native import ops

VARIANTS: dict[str, int] = {"noisy_context": 0, "clean_context": 1, "windowed": 2}
# Block tables per (layout's values, device), shared by equal layouts: training packs a new
# JacobiLayout per sequence, and the sm_90a tile lists cached on a table (kernels/attention.py)
# take ~10-60 ms of host time to build at 4k-16k tokens. LRU, a few KB per table on the host
# and its tile lists (<= ~0.5 MB at 16k tokens) on the GPU.
_TABLES: OrderedDict = OrderedDict()
_TABLES_KEPT = 64


def _resolved(device: torch.device | str) -> torch.device:
    """``device`` as tensors report theirs: "cuda" is "cuda:<current device>"."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True, eq=False)
class BlockTable:
    """A block-causal visibility table.

    The sequence is cut into contiguous blocks; block ``b`` covers tokens
    ``[block_start[b], block_start[b+1])``. Query block ``qb`` sees the key blocks
    ``kv_idx[kv_ptr[qb]:kv_ptr[qb+1]]`` (ascending, each ``< qb``) fully, and its own block
    causally (key index <= query index). All three tensors are int32 and 1-D.
    """

    block_start: torch.Tensor
    kv_ptr: torch.Tensor
    kv_idx: torch.Tensor
    # Read once from block_start[-1] at construction, so that using a table inside a
    # torch.compile'd function needs no data-dependent read of its tensors.
    seq_len: int = field(default=-1, compare=False)

    def __post_init__(self) -> None:
        if self.seq_len < 0:
            object.__setattr__(self, "seq_len", int(self.block_start[-1]))

    @property
    def num_blocks(self) -> int:
        return self.block_start.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.block_start.device

    def to(self, device: torch.device | str) -> BlockTable:
        device = _resolved(device)
        if device == self.device:
            return self
        return BlockTable(*(t.to(device) for t in self.tensors()), seq_len=self.seq_len)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.block_start, self.kv_ptr, self.kv_idx

    def token_blocks(self) -> torch.Tensor:
        """LongTensor [seq_len]: the block of every token."""
        bs = self.block_start.long()
        return torch.repeat_interleave(torch.arange(self.num_blocks, device=bs.device), bs.diff())

    def block_mask(self) -> torch.Tensor:
        """BoolTensor [num_blocks, num_blocks]: off-diagonal full visibility, block level."""
        nb = self.num_blocks
        kp = self.kv_ptr.long()
        rows = torch.repeat_interleave(torch.arange(nb, device=kp.device), kp.diff())
        m = torch.zeros(nb, nb, dtype=torch.bool, device=kp.device)
        m[rows, self.kv_idx.long()] = True
        return m

    def dense_mask(self) -> torch.Tensor:
        """BoolTensor [seq_len, seq_len], True where query (row) may attend key (column).

        For tests and small references only: the kernels never build it.
        """
        tb = self.token_blocks()
        idx = torch.arange(tb.numel(), device=tb.device)
        same = tb[:, None] == tb[None, :]
        return (same & (idx[None, :] <= idx[:, None])) | self.block_mask()[tb[:, None], tb[None, :]]

    def block_rows(self, order: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """int32 [num_blocks]: the memory row where each block of ``self.reorder(order)`` starts
        (the ``block_row`` argument of the ``block_attention_ordered_*`` ops)."""
        order = torch.as_tensor(order, dtype=torch.long).cpu()
        return self.block_start.cpu()[:-1][order].to(torch.int32).to(self.device)

    def reorder(self, order: Sequence[int] | torch.Tensor) -> tuple[BlockTable, torch.Tensor]:
        """The same visibility with the blocks placed in ``order`` (new position -> old block).

        Returns the reordered table and ``perm`` (LongTensor [seq_len]: new token -> old token),
        so that ``x.index_select(-2, perm)`` lays a sequence out in the new order. Every key
        block a query block sees must come before it in ``order``.
        """
        nb = self.num_blocks
        order = torch.as_tensor(order, dtype=torch.long).cpu()
        if order.numel() != nb or not torch.equal(order.sort().values, torch.arange(nb)):
            raise ValueError(f"order must be a permutation of range({nb}), got {order.tolist()}")
        bs = self.block_start.long().cpu()
        lens = bs.diff()[order]
        new_bs = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        seq = torch.arange(int(new_bs[-1]))
        perm = seq + torch.repeat_interleave(bs[:-1][order] - new_bs[:-1], lens)
        inv_order = torch.empty_like(order)
        inv_order[order] = torch.arange(nb)
        kp = self.kv_ptr.long().cpu()
        rows = inv_order[torch.repeat_interleave(torch.arange(nb), kp.diff())]
        cols = inv_order[self.kv_idx.long().cpu()]
        if bool((cols >= rows).any()):
            raise ValueError(
                "order must place every visible key block before the query blocks that see it"
            )
        key = (rows * nb + cols).sort().values
        new_kp = torch.cat(
            [torch.zeros(1, dtype=torch.long), torch.bincount(rows, minlength=nb).cumsum(0)]
        )
        table = BlockTable(new_bs.int(), new_kp.int(), (key % nb).int())
        return table.to(self.device), perm.to(self.device)


class StreamPlan(NamedTuple):
    """A layout reordered for the kernel: ``table`` in processing order, ``block_row`` (where
    each of its blocks starts in memory), and the token permutation ``perm`` (processing ->
    memory) with its inverse ``inv``, for devices whose kernel takes no ``block_row``."""

    table: BlockTable
    block_row: torch.Tensor
    perm: torch.Tensor
    inv: torch.Tensor


@dataclass(frozen=True)
class JacobiLayout:
    """One packed Jacobi Forcing training sequence (docs/method.md §1).

    Args:
        prompt_len: P >= 0 prompt tokens.
        block_size: n >= 1 tokens per block.
        num_blocks: T >= 0 (noisy, clean) block pairs. T = 0 is a plain causal prompt.
        variant: "noisy_context" (the published recipe), "clean_context" (CLLM-style) or
            "windowed" (needs ``window``).
        window: pairs per window for "windowed"; must be None otherwise.
    """

    prompt_len: int
    block_size: int
    num_blocks: int
    variant: str = "noisy_context"
    window: int | None = None
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("prompt_len", "block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {self.prompt_len}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {self.variant!r}")
        if self.variant == "windowed":
            if not isinstance(self.window, int) or self.window < 1:
                raise ValueError(
                    f"variant='windowed' needs window=<pairs per window, >= 1>, got {self.window!r}"
                )
        elif self.window is not None:
            raise ValueError(
                f"window is only used by variant='windowed' (got variant={self.variant!r})"
            )

    @property
    def seq_len(self) -> int:
        return self.prompt_len + 2 * self.num_blocks * self.block_size

    def position_ids(self, device: torch.device | str | None = None) -> torch.Tensor:
        """LongTensor [seq_len]: i for the prompt, P + j*n + offset for both noisy_j and clean_j."""
        P, n = self.prompt_len, self.block_size
        i = torch.arange(self.seq_len, device=device)
        r = (i - P).clamp(min=0)
        resp = P + (r // (2 * n)) * n + r % n
        return torch.where(i < P, i, resp)

    def block_table(self, device: torch.device | str | None = None) -> BlockTable:
        """The kernels' table in the natural (packed) token order, from ``jf_block_table``;
        one object per device, shared by equal layouts (``_TABLES``): the sm_90a tile lists are
        cached on it (kernels/attention.py), and a fresh copy per call built them again on the
        host at every call (jacobi_attention with sm90 at 4-6x the op's time:
        docs/results/h200-2026-11-28)."""
        device = _resolved(device if device is not None else "cpu")
        key = (self.prompt_len, self.block_size, self.num_blocks, self.variant, self.window,
               str(device))  # fmt: skip
        table = _TABLES.get(key)
        if table is None:
            if device.type == "cpu":
                table = BlockTable(*ops.jf_block_table(
                    self.prompt_len, self.block_size, self.num_blocks, VARIANTS[self.variant],
                    self.window or 0,
                ))  # fmt: skip
            else:
                table = self.block_table("cpu").to(device)
            _TABLES[key] = table
            while len(_TABLES) > _TABLES_KEPT:
                _TABLES.popitem(last=False)
        _TABLES.move_to_end(key)
        return table

    def dense_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """BoolTensor [seq_len, seq_len], True where query (row) may attend key (column)."""
        return self.block_table(device).dense_mask()

    def stream_order(self) -> list[int]:
        """Blocks in "stream order": prompt, clean_0..clean_{T-1}, noisy_0..noisy_{T-1}.

        Valid for all three variants (every block a query sees comes earlier). In this order
        each query block sees at most two contiguous runs of keys plus its own block, so the
        kernel's tiles are almost all fully visible: noisy_context becomes two causal streams
        sharing the prompt.
        """
        p = 1 if self.prompt_len > 0 else 0
        T = self.num_blocks
        return list(range(p)) + [p + 2 * j + 1 for j in range(T)] + [p + 2 * j for j in range(T)]

    def stream_plan(self, device: torch.device | str) -> StreamPlan:
        """The layout in stream order, on ``device``; cached per device."""
        device = torch.device(device)
        key = ("stream", str(device))
        if key not in self._cache:
            natural = self.block_table()
            order = self.stream_order()
            table, perm = natural.reorder(order)
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.numel())
            self._cache[key] = StreamPlan(
                table.to(device),
                natural.block_rows(order).to(device),
                perm.to(device),
                inv.to(device),
            )
        return self._cache[key]

    def flex_mask_mod(self, device: torch.device | str | None = None) -> Callable:
        """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` for this layout (the GPU baseline).

        Built from the same block table: a token -> block map and the block-level visibility
        matrix, both captured tensors on ``device``.
        """
        return table_mask_mod(self.block_table(device))


def table_mask_mod(table: BlockTable) -> Callable:
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` for a block table: a token -> block map
    and the block-level visibility matrix (captured tensors on the table's device), plus
    causality inside the diagonal block."""
    tb = table.token_blocks()
    bm = table.block_mask()

    def mask_mod(b, h, q_idx, kv_idx):
        qb, kb = tb[q_idx], tb[kv_idx]
        return ((qb == kb) & (kv_idx <= q_idx)) | bm[qb, kb]

    return mask_mod
